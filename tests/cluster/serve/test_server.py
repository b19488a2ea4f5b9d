"""``duet serve``'s front-end on a real disaggregated cluster (demo model, 1 prefill + 1 decode over gloo, on the
session's Ray cluster): the SDK (sync and async), the official ``openai`` package, raw gRPC, bad input, auth,
cancellation, the concurrency cap, and a 64-stream load. Every scenario ends with no KV block held.

One front-end (with a token, cap 64) serves most tests; a second one over the same cluster has a cap of 2.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import grpc
import httpx
import pytest

from cluster.serve import Limits, ServeConfig, ServerThread
from duet_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
)
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc
from tests.cluster.serve.conftest import SHAPES_ANSWER, png_header_only, requests_counted, wait_idle

TOKEN = "s3cret"
SHAPES = Path(__file__).resolve().parents[3] / "examples" / "shapes.png"
DESCRIBE = "<image>Describe the image."


@pytest.fixture(scope="module")
def server(serve_cluster):
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0, token=TOKEN, drain_timeout_s=5))
    srv = t.start()
    yield srv
    t.stop()


@pytest.fixture(scope="module")
def capped(serve_cluster):
    limits = Limits(max_concurrent=2, max_message_bytes=1 << 20)
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0, limits=limits))
    srv = t.start()
    yield srv
    t.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_target, token=TOKEN) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as h:
        yield h


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _assert_no_leaks(cluster) -> None:
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held


# ---------------------------------------------------------------------------------------------------------- SDK
def test_sdk_streams_the_demo_answer_with_usage_and_timeline(client, serve_cluster):
    with client.generate(DESCRIBE, images=[SHAPES], max_tokens=32) as stream:
        deltas = list(stream)
    c = stream.completion
    assert c.text == SHAPES_ANSWER == "".join(d.text for d in deltas)
    assert c.token_ids == [t for d in deltas for t in d.token_ids]
    assert c.finish_reason == "stop" and c.request_id
    assert c.usage.completion_tokens == len(c.token_ids) and c.usage.prompt_tokens > 12  # at least 12 visual tokens
    t = c.timeline
    assert t["kv_transfer"]["transport"] == "gloo" and t["kv_transfer"]["bytes"] > 0 and t["kv_transfer"]["layers"] == 4
    assert t["prefill_worker"] == "prefill-0" and t["decode_worker"] == "decode-0" and t["attempts"] == 1
    assert 0 < t["ttft_seconds"] <= t["total_seconds"] and t["queue_seconds"] >= t["preprocess_seconds"] > 0
    b = t["ttft_breakdown"]  # the stages add up to the TTFT; each RPC and the prefill compute take some time
    assert sum(b.values()) == pytest.approx(t["ttft_seconds"], abs=1e-6)
    assert min(b["decode_allocate_seconds"], b["prefill_compute_seconds"], b["decode_commit_seconds"]) > 0
    assert t["vision_encode_seconds"] == b["vision_encode_seconds"] >= 0  # 0 when the image was encoded before
    _assert_no_leaks(serve_cluster)


def test_sdk_takes_bytes_and_pil_images_and_chat_messages(client):
    from PIL import Image

    assert client.generate_text("<image>How many shapes are there?", images=[SHAPES.read_bytes()]).text == "3"
    assert client.generate_text(DESCRIBE, images=[Image.open(SHAPES)]).text == SHAPES_ANSWER
    chat = [{"role": "user", "content": DESCRIBE}]
    assert client.generate_text(messages=chat, images=[SHAPES]).text == SHAPES_ANSWER


def test_stop_strings_and_max_tokens(client):
    c = client.generate_text(DESCRIBE, images=[SHAPES], stop=[","])
    assert (c.text, c.finish_reason, c.stop) == ("red triangle top left", "stop", ",")
    c = client.generate_text(DESCRIBE, images=[SHAPES], max_tokens=2)
    assert c.finish_reason == "length" and len(c.token_ids) == 2


def test_async_sdk_concurrent_requests(server, serve_cluster):
    async def go():
        async with AsyncClient(server.grpc_target, token=TOKEN) as ac:
            models = await ac.list_models()
            texts = await asyncio.gather(*(ac.generate_text(DESCRIBE, images=[SHAPES]) for _ in range(4)))
            pieces = [d.text async for d in ac.generate(DESCRIBE, images=[SHAPES])]
            return models, [t.text for t in texts], "".join(pieces)

    models, texts, streamed = asyncio.run(go())
    assert models[0]["id"] == "duet-demo" and models[0]["vision"] and models[0]["max_model_len"] == 1024
    assert texts == [SHAPES_ANSWER] * 4 and streamed == SHAPES_ANSWER
    _assert_no_leaks(serve_cluster)


def test_cli_client_prints_the_answer(server, capsys, monkeypatch):
    from cluster.cli.main import main

    monkeypatch.setenv("DUET_TOKEN", TOKEN)
    rc = main(["client", "generate", "--target", server.grpc_target, "<image>How many shapes are there?",
               "--image", str(SHAPES)])
    assert rc == 0 and capsys.readouterr().out == "3\n"
    monkeypatch.setenv("DUET_TOKEN", "wrong")
    assert main(["client", "models", "--target", server.grpc_target]) == 2
    assert "wrong bearer token" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- OpenAI
def test_openai_package_chat_with_an_image(server, serve_cluster):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{server.http_url}/v1", api_key=TOKEN)
    assert [m.id for m in oai.models.list().data] == ["duet-demo"]
    content = [{"type": "image_url", "image_url": {"url": _data_url(SHAPES.read_bytes())}},
               {"type": "text", "text": "Describe the image."}]
    messages = [{"role": "user", "content": content}]
    r = oai.chat.completions.create(model="duet-demo", messages=messages, max_tokens=32)
    assert r.choices[0].message.content == SHAPES_ANSWER and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model="duet-demo", messages=messages, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SHAPES_ANSWER
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    comp = oai.completions.create(model="duet-demo", prompt="red triangle", max_tokens=3, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 3
    _assert_no_leaks(serve_cluster)


def test_health_and_metrics(server, http):
    assert httpx.get(f"{server.http_url}/health").json() == {"status": "ok"}  # no token needed
    text = http.get("/metrics").text
    assert 'duet_requests_total{api="grpc",outcome="ok"}' in text and "duet_kv_free_blocks" in text
    assert httpx.get(f"{server.http_url}/metrics").status_code == 401


# ----------------------------------------------------------------------------------------------------- raw gRPC
def test_raw_grpc_generate_status_and_health(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    md = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.DuetStub(ch)
        req = pb.GenerateRequest(api_version=1, prompt="<image>How many shapes are there?",
                                 images=[pb.Image(data=SHAPES.read_bytes(), mime_type="image/png")])
        resps = list(stub.Generate(req, metadata=md, timeout=60))
        assert [r.WhichOneof("kind") for r in resps][-1] == "final"
        assert "".join(r.delta.text for r in resps[:-1]) == "3"
        final = resps[-1].final
        assert final.finish_reason == pb.FINISH_REASON_STOP and final.usage.completion_tokens == 2
        assert final.timeline.kv_transfer.bytes > 0 and final.timeline.decode_worker == "decode-0"
        status = stub.ClusterStatus(pb.ClusterStatusRequest(api_version=1), metadata=md, timeout=30)
        assert {w.worker_id for w in status.workers} == {"prefill-0", "decode-0"}
        assert all(w.alive for w in status.workers)
        assert all(w.kv_pool_bytes > 0 and w.kv_mirror_bytes > 0 for w in status.workers)
        assert status.kv_memory_bytes == sum(w.kv_pool_bytes + w.kv_mirror_bytes for w in status.workers)
        assert status.experts.num_layers == 4 and status.experts.num_experts == 8 and status.experts.tokens_routed > 0
        assert all(0 < b <= 1 for b in status.experts.balancedness)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="duet.v1.Duet"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health needs no token
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(api_version=99, prompt="hi"), metadata=md, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "api_version" in e.value.details()


# ---------------------------------------------------------------------------------------------------- bad input
BAD_INPUTS = {
    "undecodable image": ({"prompt": DESCRIBE, "images": [b"definitely not an image"]}, "not a recognised image"),
    "image over the pixel cap": ({"prompt": DESCRIBE, "images": [png_header_only(20_000, 20_000)]},
                                 "over the limit of 16777216 pixels"),
    "truncated image": ({"prompt": DESCRIBE, "images": [SHAPES.read_bytes()[:200]]}, "truncated or corrupt"),
    "empty prompt": ({"prompt": ""}, "the prompt is empty"),
    "negative max_tokens": ({"prompt": "hi", "max_tokens": -3}, "max_tokens must be at least 1"),
    "huge max_tokens": ({"prompt": "hi", "max_tokens": 1_000_000}, "over this server's limit of 1024"),
    "max_tokens past the context": ({"prompt": "hi", "max_tokens": 1020}, "does not fit the context"),
    "unknown model": ({"prompt": "hi", "model": "gpt-9"}, "model 'gpt-9' is not served here"),
    "prompt over the context": ({"prompt": [5] * 2000}, "prompt has 2000 tokens; the context holds 1024"),
    "image without placeholder": ({"prompt": "Describe the image.", "images": [SHAPES]}, "placeholder"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_invalid_argument_over_grpc(client, case):
    kwargs, message = BAD_INPUTS[case]
    kwargs = dict(kwargs)
    with pytest.raises(InvalidArgument, match=message):
        client.generate_text(kwargs.pop("prompt"), **kwargs)


def _http_request(kwargs: dict) -> tuple[str, dict]:
    """The OpenAI-API form of a bad input: token ids -> /v1/completions, else a chat with image parts."""
    body: dict = {"model": kwargs.get("model", "duet-demo")}
    if "max_tokens" in kwargs:
        body["max_tokens"] = kwargs["max_tokens"]
    prompt = kwargs["prompt"]
    if isinstance(prompt, list):
        return "/v1/completions", {**body, "prompt": prompt}
    parts = [{"type": "image_url", "image_url": {"url": _data_url(i if isinstance(i, bytes) else i.read_bytes())}}
             for i in kwargs.get("images", [])]
    parts.append({"type": "text", "text": prompt.replace("<image>", "")})
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": parts}]}


HTTP_CASES = [c for c in BAD_INPUTS if c != "image without placeholder"]  # chat parts always place their images


@pytest.mark.parametrize("case", HTTP_CASES, ids=HTTP_CASES)
def test_bad_input_is_400_over_http(http, case):
    kwargs, message = BAD_INPUTS[case]
    path, body = _http_request(kwargs)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_http_shape_errors(http, server):
    assert http.post("/v1/chat/completions", content=b"{not json").json()["error"]["message"] == \
        "the request body is not valid JSON"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
    assert r.status_code == 400 and "data: URLs" in r.json()["error"]["message"]
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json={}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get("/v1/nothing").status_code == 404
    for stream in (False, True):  # echo of a token id past the vocabulary: the 400 of any such id, not a 500
        r = http.post("/v1/completions", json={"prompt": [4294967296], "echo": True, "stream": stream})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text


def test_wrong_or_missing_token_is_unauthenticated(server):
    for token in ("wrong", None):
        with Client(server.grpc_target, token=token) as c, pytest.raises(Unauthenticated, match="bearer token"):
            c.generate_text("hi")


def test_server_keeps_serving_after_bad_input_with_no_block_held(client, serve_cluster):
    assert client.generate_text(DESCRIBE, images=[SHAPES]).text == SHAPES_ANSWER
    _assert_no_leaks(serve_cluster)


# -------------------------------------------------------------------------------------------- cancel and abort
LONG = {"raw_prompt": True, "max_tokens": 900, "ignore_eos": True}  # ~900 decode steps: still running when cancelled


def test_client_cancel_mid_stream_frees_both_workers_within_a_second(client, serve_cluster, http):
    before = requests_counted(http, "cancelled")
    stream = client.generate("red", **LONG)
    first = next(stream)
    assert first.token_ids
    stream.close()
    assert wait_idle(serve_cluster, timeout_s=5) < 1.0
    assert requests_counted(http, "cancelled") == before + 1  # cut short, not run to the end


def test_deadline_exceeded_aborts_the_request(client, serve_cluster):
    with pytest.raises(DeadlineExceeded):
        client.generate_text("red", timeout=0.5, **LONG)
    # the server learns of an expired deadline from gRPC, possibly while the request is still in prefill; the
    # one-second bound is the mid-stream cancel above, here only that it is freed promptly
    assert wait_idle(serve_cluster, timeout_s=5) < 3.0


def test_async_cancel_and_abort_by_id(server, serve_cluster):
    async def go():
        async with AsyncClient(server.grpc_target, token=TOKEN) as ac:
            stream = ac.generate("red", request_id="long-1", **LONG)
            await stream.__anext__()
            assert await ac.abort("long-1") and not await ac.abort("no-such-request")
            async for _ in stream:
                pass
            return stream.completion

    c = asyncio.run(go())
    assert c.finish_reason == "abort" and c.usage.completion_tokens < 900
    assert wait_idle(serve_cluster, timeout_s=5) < 3.0


def test_http_client_disconnect_aborts_the_request(http, serve_cluster):
    before = requests_counted(http, "cancelled", api="http")
    with http.stream("POST", "/v1/completions", json={"prompt": "red", "max_tokens": 900, "ignore_eos": True,
                                                       "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    assert wait_idle(serve_cluster, timeout_s=5) < 1.0
    assert requests_counted(http, "cancelled", api="http") == before + 1


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "red"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "red"}]})])
def test_a_stream_read_to_its_end_counts_as_served(http, path, body):
    """A streamed reply the client read to ``[DONE]`` counts as ``ok``, not ``cancelled`` (the front-end closed the
    event stream after its final event, which counted every streamed request as cancelled)."""
    ok, cancelled = requests_counted(http, "ok", api="http"), requests_counted(http, "cancelled", api="http")
    with http.stream("POST", path, json={**body, "max_tokens": 4, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert requests_counted(http, "ok", api="http") == ok + 1
    assert requests_counted(http, "cancelled", api="http") == cancelled


# ----------------------------------------------------------------------------------------------- cap and load
def test_over_the_concurrency_cap_is_resource_exhausted_and_429(capped, serve_cluster):
    with Client(capped.grpc_target) as c:
        held = [c.generate("red", **LONG) for _ in range(2)]
        for s in held:
            next(s)
        t0 = time.monotonic()
        with pytest.raises(ResourceExhausted, match="limit of 2 concurrent") as e:
            c.generate_text("red")
        assert e.value.retry_after_s and 0 < e.value.retry_after_s <= 30 and time.monotonic() - t0 < 5
        r = httpx.post(f"{capped.http_url}/v1/completions", json={"prompt": "red"}, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        for s in held:
            s.close()
    wait_idle(serve_cluster)
    with Client(capped.grpc_target) as c:
        assert c.generate_text(DESCRIBE, images=[SHAPES]).text == SHAPES_ANSWER


def test_message_size_cap(capped):
    big = b"\x89PNG\r\n\x1a\n" + bytes(2 << 20)
    with Client(capped.grpc_target) as c, pytest.raises(ResourceExhausted, match="larger than max"):
        c.generate_text(DESCRIBE, images=[big])
    r = httpx.post(f"{capped.http_url}/v1/chat/completions", timeout=30, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(big)}}]}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_64_concurrent_streams_complete_without_error_or_leak(server, serve_cluster):
    async def one(ac: AsyncClient, i: int) -> list[int]:
        images = [SHAPES] if i % 2 else []
        prompt = DESCRIBE if i % 2 else "How many shapes are there?"
        return [t async for d in ac.generate(prompt, images=images, max_tokens=4, ignore_eos=True)
                for t in d.token_ids]

    async def go():
        async with AsyncClient(server.grpc_target, token=TOKEN) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    t0 = time.monotonic()
    results = asyncio.run(go())
    elapsed = time.monotonic() - t0
    assert [len(r) for r in results] == [4] * 64
    print(f"64 concurrent streams: {elapsed:.2f} s")
    _assert_no_leaks(serve_cluster)
