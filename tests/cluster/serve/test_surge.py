"""A surge of image requests far beyond what the prefill pool can serve before the requests' timeout, over HTTP: each
request either completes or is refused up front with 429 and a retry hint; none fails with a 5xx after work was done
for it, and nothing is held once the surge has passed."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import pytest

from cluster.demo import default_model_dir
from cluster.serve import ServeConfig, ServerThread
from tests.cluster.serve.conftest import requests_counted, wait_idle

SHAPES = Path(__file__).resolve().parents[3] / "examples" / "shapes.png"
TIMEOUT_S = 12.0  # each request's deadline (request_timeout_s)


@pytest.fixture(scope="module")
def slow_cluster(ray_cluster):
    """1 prefill + 1 decode on the demo model; the prefill worker sleeps after each layer, so a prompt takes about a
    second and the surge below is several times what it gets through before the requests' deadline."""
    import ray

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=str(default_model_dir()), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport="gloo",
                       num_kv_blocks=256, cpus_per_worker=1, request_timeout_s=TIMEOUT_S, max_num_batched_tokens=64)
    cluster = DisaggCluster(spec)
    try:
        # the demo model has 4 layers: a prefill step takes about a second
        ray.get(cluster.prefills[0].actor.inject_fault.remote("layer_delay_s", 0.25), timeout=10)
        yield cluster
    finally:
        cluster.shutdown()


def _chat(max_tokens: int = 4) -> dict:
    url = "data:image/png;base64," + base64.b64encode(SHAPES.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]
    return {"model": "duet-demo", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


def test_an_image_surge_beyond_capacity_completes_or_is_refused_up_front(slow_cluster):
    t = ServerThread(slow_cluster, ServeConfig(grpc_port=0, http_port=0))
    server = t.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=60) as http:
            warm = http.post("/v1/chat/completions", json=_chat())  # the worker's speed is measured from here on
            assert warm.status_code == 200, warm.text

            async def surge() -> list[tuple[int, float, dict]]:
                async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
                    async def one(i: int) -> tuple[int, float, dict]:
                        await asyncio.sleep(0.05 * i)  # a burst, not one instant
                        t0 = time.monotonic()
                        r = await client.post("/v1/chat/completions", json=_chat())
                        return r.status_code, time.monotonic() - t0, {"headers": dict(r.headers), "body": r.json()}

                    return list(await asyncio.gather(*(one(i) for i in range(24))))

            got = asyncio.run(surge())
            codes = [c for c, _, _ in got]
            assert set(codes) <= {200, 429}, [(c, r["body"]) for c, _, r in got if c not in (200, 429)]
            done, refused = [g for g in got if g[0] == 200], [g for g in got if g[0] == 429]
            assert done and refused, codes  # the surge was beyond capacity, and the pool still served part of it
            for _, _, r in done:
                assert r["body"]["choices"][0]["message"]["content"] and r["body"]["usage"]["completion_tokens"] > 0
            for _, took, r in refused:
                assert took < 2.0, took  # refused up front, not after waiting out its timeout
                assert int(r["headers"]["retry-after"]) >= 1 and r["body"]["error"]["type"] == "rate_limit_error"
            assert requests_counted(http, "ok", api="http") >= len(done)
            assert "duet_requests_refused_total" in http.get("/metrics").text
        assert wait_idle(slow_cluster, timeout_s=30) < 30
        held = slow_cluster.check_no_leaks()
        assert held and all(v == 0 for v in held.values()), held
    finally:
        t.stop()
