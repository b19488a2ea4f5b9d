"""The served API on the default small-host deployment, where the decode worker prefills short text prompts itself
(``ClusterSpec.local_prefill_tokens``): the HTTP reply is the engine's text, its timeline names the decode worker as
where the prompt was prefilled (``kv_transfer.transport == "local"``); a request whose own step fails there gets a
typed 500 while the requests sharing its steps complete unchanged; a longer prompt still goes to the prefill worker;
nothing is held afterwards."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

from tests.cluster.serve.conftest import wait_idle

POISON = 4343
PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8, 19], [11, 3, 64, 5, 90], [71, 8, 19, 42, 5, 17]]
LIMIT = 16  # local_prefill_tokens here: each prompt above is local (at most 2 x 16 tokens pending at once)


@pytest.fixture(scope="module")
def local_cluster(ray_cluster):
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from cluster.demo import default_model_dir

    cluster = DisaggCluster(ClusterSpec(model_dir=str(default_model_dir()), num_prefill=1, num_decode=1,
                                        transport="gloo", num_kv_blocks=256, request_timeout_s=60,
                                        local_prefill_tokens=LIMIT))
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def local_server(local_cluster):
    from cluster.serve import ServeConfig, ServerThread

    t = ServerThread(local_cluster, ServeConfig(grpc_port=0, http_port=0))
    yield t.start()
    t.stop()


def _body(prompt: list[int], seed: int | None = None, **kw) -> dict:
    return {"model": "duet-demo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            **({} if seed is None else {"seed": seed}), **kw}


def _engine_texts(prompts: list[list[int]]) -> list[str]:
    from cluster.demo import default_model_dir
    from engine import LLM, SamplingParams

    llm = LLM(default_model_dir(), dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def test_a_short_text_prompt_is_prefilled_on_the_decode_worker(local_server, local_cluster):
    long_prompt = (PROMPTS[0] * 3)[:LIMIT + 4]  # over the limit: the prefill worker
    want = _engine_texts([*PROMPTS, long_prompt])
    with httpx.Client(base_url=local_server.http_url, timeout=60) as http:
        got = [http.post("/v1/completions", json=_body(p)) for p in [*PROMPTS, long_prompt]]
    for r, text in zip(got, want, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
    timelines = [r.json()["duet_timeline"] for r in got]
    for t in timelines[:-1]:  # one at a time: each within the limit
        assert t["prefill_worker"] == t["decode_worker"] == "decode-0" and t["kv_transfer"]["transport"] == "local"
    assert timelines[-1]["prefill_worker"] == "prefill-0" and timelines[-1]["kv_transfer"]["bytes"] > 0
    wait_idle(local_cluster)


def test_a_failing_local_request_fails_alone(local_server, local_cluster):
    want = _engine_texts(PROMPTS)
    workers = local_cluster.decodes + local_cluster.prefills
    ray.get([w.actor.inject_request_fault.remote("sample", POISON) for w in workers], timeout=30)
    try:
        async def batch() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=local_server.http_url, timeout=60) as client:
                bodies = [_body(p) for p in PROMPTS] + [_body(PROMPTS[1], POISON)]
                return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))

        got = asyncio.run(batch())
    finally:
        ray.get([w.actor.inject_request_fault.remote("sample", -1) for w in workers], timeout=30)
    for r, text in zip(got[:len(PROMPTS)], want, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
    err = got[-1].json()["error"]
    assert got[-1].status_code == 500 and err["code"] == "request_failed" and "fault injected at sample" in \
        err["message"], err
    assert any(r.json()["duet_timeline"]["kv_transfer"]["transport"] == "local" for r in got[:len(PROMPTS)])
    wait_idle(local_cluster)
    assert all(w.local_tokens == 0 and w.inflight == 0 for w in local_cluster.decodes)
