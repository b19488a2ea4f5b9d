"""What the HTTP and gRPC fuzz tests share: the example count, the front-end they fuzz, and the end-of-run checks.

Short form (CI): :data:`DEFAULT_EXAMPLES` per test. Long form: ``DUET_FUZZ_EXAMPLES=2000`` (per test file, split
over its tests) — e.g. ``DUET_FUZZ_EXAMPLES=2000 pytest -q tests/cluster/serve/test_fuzz_http.py
tests/cluster/serve/test_fuzz_grpc.py``; each file prints how many requests it sent and how they were answered.

The front-end runs with tight limits so generated requests stay cheap whatever their values: at most
:data:`MAX_TOKENS` generated tokens, small bodies and images. Generated values outside those limits must then be
refused with a typed error like any other bad value.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator

import grpc
from hypothesis import HealthCheck, settings

from cluster.serve import Limits, ServeConfig, Server, ServerThread
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc
from tests.cluster.serve.conftest import wait_idle

TOKEN = "fuzz-token"
DEFAULT_EXAMPLES = 160  # per test file
MAX_TOKENS = 2
LIMITS = Limits(max_concurrent=8, max_message_bytes=256 * 1024, max_image_bytes=64 * 1024,
                max_image_pixels=512 * 512, max_images=2, max_prompt_tokens=200, max_tokens=MAX_TOKENS)


def total_examples() -> int:
    """Examples per test file: ``DUET_FUZZ_EXAMPLES`` or :data:`DEFAULT_EXAMPLES`."""
    return int(os.environ.get("DUET_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings for one fuzz loop: no deadline (a real cluster answers), no shrinking database.
    The CI form (no ``DUET_FUZZ_EXAMPLES``) seeds Hypothesis from the test (derandomized), though the cases drawn
    still vary between runs (the schema strategies follow set order, which hash randomization changes: print_blob
    names a failing case); the long form explores afresh each run."""
    return settings(max_examples=max(1, examples), deadline=None, database=None,
                    derandomize="DUET_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=list(HealthCheck), print_blob=True)




class Tally:
    """Counts replies by kind (``"http 400 invalid_request_error"``, ``"grpc INVALID_ARGUMENT"``); thread-safe."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, name: str) -> str:
        rows = "\n".join(f"  {n:6d}  {k}" for k, n in sorted(self.counts.items()))
        return f"{name}: {self.total} requests\n{rows}"


@contextlib.contextmanager
def serving(cluster, tally: Tally, name: str) -> Iterator[Server]:
    """A front-end with :data:`LIMITS` over ``cluster``; prints ``tally``'s report when it stops."""
    t = ServerThread(cluster, ServeConfig(grpc_port=0, http_port=0, token=TOKEN, limits=LIMITS, drain_timeout_s=5))
    try:
        yield t.start()
    finally:
        t.stop()
        print("\n" + tally.report(name))


def assert_cluster_clean(server, cluster) -> None:
    """After a fuzz run: every worker alive, no request in flight, no KV block held (from ``ClusterStatus`` and
    from the workers' own leak check), and the server still serves a good request."""
    wait_idle(cluster, timeout_s=30)
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.DuetStub(ch)
        md = (("authorization", f"Bearer {TOKEN}"),)
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), metadata=md, timeout=30)
        assert st.workers and all(w.alive for w in st.workers), st
        assert st.in_flight == 0 and st.kv_usage == 0.0, st
        for w in st.workers:
            if w.role == pb.WORKER_ROLE_DECODE:
                assert w.free_blocks == w.total_blocks > 0 and w.running == w.receiving == 0, w
        good = pb.GenerateRequest(prompt="Hello", raw_prompt=True, sampling=pb.SamplingParams(max_tokens=1))
        replies = list(stub.Generate(good, metadata=md, timeout=60))
        assert replies[-1].final.usage.completion_tokens == 1, replies
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held
