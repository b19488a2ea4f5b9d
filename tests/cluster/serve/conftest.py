"""Fixtures and helpers of the serving tests.

* ``serve_cluster`` (package scope): one :class:`DisaggCluster` (1 prefill + 1 decode, gloo) on the demo model, on
  the session's shared Ray cluster; front-ends (:class:`ServerThread`) are started over it per module.
* :func:`png_header_only` forges a PNG that declares any size in a few dozen bytes (a decompression-bomb probe);
  :func:`wait_idle` waits until no worker holds a request or a KV block and returns how long that took;
  :func:`requests_counted` reads a front-end's request counter for one outcome.
"""

from __future__ import annotations

import struct
import time
import zlib

import pytest

from cluster.demo import default_model_dir
from node_common import messages

SHAPES_ANSWER = "red triangle top left, blue circle right, green square bottom"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` (RGB, 8 bit) with no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def wait_idle(cluster, timeout_s: float = 10.0) -> float:
    """Seconds until every live worker is idle and holds no KV block (raises AssertionError past ``timeout_s``)."""
    import ray

    t0 = time.monotonic()
    workers = [w for w in cluster.prefills + cluster.decodes if w.load.alive]
    while True:
        states = [messages.unpack(r) for r in ray.get([w.actor.check_no_leaks.remote() for w in workers])]
        if all(s["idle"] and s["held"] == 0 for s in states):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"workers still busy after {timeout_s} s: {states}"
        time.sleep(0.02)


def requests_counted(http, outcome: str, api: str = "grpc") -> float:
    """``duet_requests_total{api, outcome}`` from the front-end's ``/metrics`` (``http``: an httpx client on it)."""
    prefix = f'duet_requests_total{{api="{api}",outcome="{outcome}"}} '
    return next((float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                 if line.startswith(prefix)), 0.0)


@pytest.fixture(scope="package")
def serve_cluster(ray_cluster):
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=str(default_model_dir()), num_prefill=1, num_decode=1, transport="gloo",
                       num_kv_blocks=512, cpus_per_worker=1, request_timeout_s=60,
                       local_prefill_tokens=0)  # the API over the disaggregated path (test_local_prefill_serve: local)
    cluster = DisaggCluster(spec)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def server(serve_cluster):
    """A front-end with the default config (gRPC and HTTP on free loopback ports) on ``serve_cluster``, for one test
    module (a module that needs another config defines its own ``server``)."""
    from cluster.serve import ServeConfig, ServerThread

    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0))
    srv = t.start()
    yield srv
    t.stop()
