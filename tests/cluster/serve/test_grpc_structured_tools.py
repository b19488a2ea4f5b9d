"""Structured outputs and tool calls over gRPC (``duet.v1`` api_version 3) through the SDK, against one front-end on
the demo model (1 prefill + 1 decode over gloo), each checked against the HTTP API's reply to the same request on the
same front-end: the same seeded ``json_schema`` text (which validates), the same parsed tool calls under
``tool_choice`` required or a named tool, the same tool-call round trip; the same mistakes refused with the same words
(INVALID_ARGUMENT / 400), nothing held after them; a request of an older api_version that sets a version-3 field is
refused naming it, and one without such fields is answered as before."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from cluster.serve.grpc_api import API_VERSION
from duet_client import Client, InvalidArgument
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc
from tests.cluster.serve.conftest import wait_idle
from tests.cluster.serve.test_structured import ASK, CLOCK, SCHEMA, WEATHER

OSLO = [{"role": "user", "content": "Weather in Oslo?"}]
SHAPES_FORMAT = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_target) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as h:
        yield h


def _http_chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "duet-demo", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _http_error(http, path: str = "/v1/chat/completions", **body) -> str:
    r = http.post(path, json={"model": "duet-demo", **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_reply_is_the_http_reply_and_validates(client, http, serve_cluster, seed):
    kw = {"temperature": 1.0, "seed": seed, "max_tokens": 48, "response_format": SHAPES_FORMAT}
    c = client.generate_text(messages=ASK, **kw)
    want = _http_chat(http, messages=ASK, **kw)["choices"][0]
    assert (c.text, c.finish_reason) == (want["message"]["content"], want["finish_reason"]) == (c.text, "stop")
    jsonschema.validate(json.loads(c.text), SCHEMA)
    assert c.content == c.text and c.tool_calls == []  # no tools: nothing parsed
    wait_idle(serve_cluster)


def test_json_object_on_a_raw_prompt_is_the_http_completion(client, http):
    kw = {"temperature": 1.0, "seed": 3, "max_tokens": 2, "response_format": {"type": "json_object"}}
    c = client.generate_text("shapes:", raw_prompt=True, **kw)
    r = http.post("/v1/completions", json={"model": "duet-demo", "prompt": "shapes:", **kw}).json()["choices"][0]
    assert (c.text, c.finish_reason) == (r["text"], r["finish_reason"]) and c.text.startswith("{")
    free = client.generate_text("shapes:", raw_prompt=True, **{**kw, "response_format": {"type": "text"}})
    assert free.text == client.generate_text("shapes:", raw_prompt=True, temperature=1.0, seed=3, max_tokens=2).text


# ------------------------------------------------------------------------------------------------------- tool calls
TOOL_CASES = {
    "named": ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 1}, 1),
    "named-by-string": ({"tool_choice": "now", "seed": 3}, 1),
    "required-one": ({"tool_choice": "required", "parallel_tool_calls": False, "seed": 5}, 1),
    "required": ({"tool_choice": "required", "seed": 2}, None),
}


@pytest.mark.parametrize("case", list(TOOL_CASES), ids=list(TOOL_CASES))
def test_tool_calls_are_the_http_reply(client, http, serve_cluster, case):
    kw, count = TOOL_CASES[case]
    kw = {"tools": [WEATHER, CLOCK], "temperature": 1.0, "max_tokens": 128, **kw}
    c = client.generate_text(messages=OSLO, **kw)
    http_choice = {"type": "function", "function": {"name": "now"}} if kw["tool_choice"] == "now" else None
    want = _http_chat(http, messages=OSLO, **{**kw, "tool_choice": http_choice or kw["tool_choice"]})
    msg = want["choices"][0]["message"]
    assert c.finish_reason == want["choices"][0]["finish_reason"] == "tool_calls"
    assert [(t.name, t.arguments) for t in c.tool_calls] == [(t["function"]["name"], t["function"]["arguments"])
                                                             for t in msg["tool_calls"]]
    assert c.content == msg["content"] and "<tool_call>" in c.text  # the deltas carried the raw text
    assert all(t.id.startswith("call_") for t in c.tool_calls) and len(c.tool_calls) == (count or len(c.tool_calls))
    for t in c.tool_calls:
        args = json.loads(t.arguments)
        if t.name == "get_weather":
            jsonschema.validate(args, WEATHER["function"]["parameters"])
        else:
            assert t.name == "now" and args == {}
    if kw["tool_choice"] != "required":
        assert {t.name for t in c.tool_calls} == {http_choice["function"]["name"] if http_choice else "get_weather"}
    assert c.choices[0].tool_calls == c.tool_calls
    wait_idle(serve_cluster)


def test_tool_call_round_trip_is_the_http_one(client, http, serve_cluster):
    call = client.generate_text(messages=OSLO, tools=[WEATHER], tool_choice="get_weather", temperature=1.0, seed=1,
                                max_tokens=128).tool_calls[0]
    turns = [*OSLO, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    follow = client.generate_text(messages=turns, tools=[WEATHER], max_tokens=8, temperature=0)
    http_turns = [*OSLO, {**turns[1], "tool_calls": [call.openai()]}, turns[2]]
    want = _http_chat(http, messages=http_turns, tools=[WEATHER], max_tokens=8, temperature=0)
    msg = want["choices"][0]["message"]
    assert follow.usage.prompt_tokens == want["usage"]["prompt_tokens"]  # the call and its result were rendered
    assert follow.content == msg["content"] and follow.finish_reason == want["choices"][0]["finish_reason"]
    assert [t.arguments for t in follow.tool_calls] == [t["function"]["arguments"] for t in msg.get("tool_calls", [])]
    bare = client.generate_text(messages=[*OSLO, {"role": "assistant", "content": ""}, turns[2]], tools=[WEATHER],
                                max_tokens=1, temperature=0)
    assert bare.usage.prompt_tokens < follow.usage.prompt_tokens  # without the assistant's call the prompt is shorter
    wait_idle(serve_cluster)


# --------------------------------------------------------------------------------------------------------- refusals
BAD_FORMATS = {
    "bad-type": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    "bad-ref": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/nowhere"}}},
    "no-schema": {"type": "json_schema", "json_schema": {"name": "x"}},
    "unknown-format": {"type": "yaml"},
}
BAD_TOOLS = {
    "unknown-tool-name": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "choice-without-tools": {"tool_choice": "required"},
    "bad-tool-name": {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    "two-constraints": {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
    "duplicate-tools": {"tools": [WEATHER, WEATHER]},
}


@pytest.mark.parametrize("case", [*BAD_FORMATS, *BAD_TOOLS], ids=[*BAD_FORMATS, *BAD_TOOLS])
def test_mistakes_are_invalid_argument_with_the_http_message(client, http, serve_cluster, case):
    kw = {"response_format": BAD_FORMATS[case]} if case in BAD_FORMATS else BAD_TOOLS[case]
    with pytest.raises(InvalidArgument) as e:
        client.generate_text(messages=ASK, max_tokens=8, **kw)
    assert e.value.details == _http_error(http, messages=ASK, max_tokens=8, **kw)
    assert any(word in e.value.details for word in ("response_format", "schema", "tool", "objekt", "nowhere"))
    assert wait_idle(serve_cluster, timeout_s=1.0) < 1.0


def test_grpc_only_mistakes_name_the_field(server, client, serve_cluster):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Go")])
    cases = [
        (pb.GenerateRequest(api_version=3, chat=chat, response_format=pb.ResponseFormat(type="json_schema",
                                                                                        schema="{")),
         "'response_format.json_schema.schema' is not valid JSON"),
        (pb.GenerateRequest(api_version=3, chat=chat, response_format=pb.ResponseFormat(type="json_object",
                                                                                        schema="{}")),
         "only for type json_schema"),
        (pb.GenerateRequest(api_version=3, chat=chat, tools=[pb.Tool(name="f", parameters="[1]")]),
         "'tools[0].function.parameters' must be a JSON Schema object"),
        (pb.GenerateRequest(api_version=3, prompt="Go", tools=[pb.Tool(name="f")]), "need a chat input"),
        (pb.GenerateRequest(api_version=3, chat=chat, tools=[pb.Tool(name="f")], tool_choice="g"),
         "'tool_choice' names function 'g', which is not in 'tools'"),
    ]
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.DuetStub(ch)
        for req, message in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), req
    assert wait_idle(serve_cluster, timeout_s=1.0) < 1.0


@pytest.mark.parametrize("version", [0, 1, 2])
def test_an_older_request_with_a_version_3_field_is_refused_naming_it(server, version):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Go")])
    cases = [(pb.GenerateRequest(chat=chat, tools=[pb.Tool(name="f")]), "'tools'"),
             (pb.GenerateRequest(prompt="Go", response_format=pb.ResponseFormat(type="json_object")),
              "'response_format'"),
             (pb.GenerateRequest(chat=chat, tool_choice="none"), "'tool_choice'"),
             (pb.GenerateRequest(chat=chat, parallel_tool_calls=True), "'parallel_tool_calls'"),
             (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="tool", tool_call_id="c", content="x")])),
              "tool_call_id")]
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.DuetStub(ch)
        for req, field in cases:
            req.api_version = version
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert field in e.value.details() and f"needs api_version {API_VERSION}" in e.value.details()


def test_a_version_2_request_is_answered_as_before(server, client):
    with grpc.insecure_channel(server.grpc_target) as ch:
        req = pb.GenerateRequest(api_version=2, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Go")]),
                                 sampling=pb.SamplingParams(max_tokens=8))
        final = list(pb_grpc.DuetStub(ch).Generate(req, timeout=60))[-1].final
    assert final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert [(c.tool_calls, c.HasField("content")) for c in final.choices] == [([], False)]
    sdk = client.generate_text(messages=[{"role": "user", "content": "Go"}], max_tokens=8)  # sent as version 2
    assert sdk.content == sdk.text and sdk.tool_calls == [] and sdk.finish_reason == {
        pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[final.finish_reason]
