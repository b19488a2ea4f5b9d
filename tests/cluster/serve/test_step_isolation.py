"""A request whose own step fails on a worker (a fault injected for requests with one seed: on the prefill worker at
its sampling, on the decode worker at a token's append) gets a typed 500 (``code: request_failed``) naming the fault,
while the valid requests sent with it complete with the tokens they get when sent alone; nothing is held afterwards."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

from tests.cluster.serve.conftest import wait_idle

POISON = 4242  # the seed the injected fault picks out
PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8, 19], [11, 3, 64, 5, 90], [71, 8, 19, 42, 5, 17], [33, 9, 11]]


def _body(prompt: list[int], seed: int | None = None) -> dict:
    return {"model": "duet-demo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            **({} if seed is None else {"seed": seed})}


@pytest.mark.parametrize("role, stage", [("prefill", "sample"), ("decode", "append")])
def test_a_failing_request_gets_a_typed_error_and_the_rest_of_its_batch_completes(server, serve_cluster, role, stage):
    alone = []
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        for p in PROMPTS:
            r = http.post("/v1/completions", json=_body(p))
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0]["text"])
    workers = serve_cluster.prefills if role == "prefill" else serve_cluster.decodes
    ray.get([w.actor.inject_request_fault.remote(stage, POISON) for w in workers], timeout=30)
    try:
        async def batch() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
                bodies = [_body(p) for p in PROMPTS] + [_body(p, POISON) for p in PROMPTS[:2]]
                return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))

        got = asyncio.run(batch())
    finally:
        ray.get([w.actor.inject_request_fault.remote(stage, -1) for w in workers], timeout=30)
    for r, want in zip(got[:len(PROMPTS)], alone, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    for r in got[len(PROMPTS):]:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "request_failed" and f"fault injected at {stage}" in err["message"], err
    wait_idle(serve_cluster)
