"""Structured outputs and tool calls with the official ``openai`` client against ``duet serve`` (demo model,
1 prefill + 1 decode over gloo): sampled ``json_schema`` replies always validate (the first token is sampled by the
prefill worker under the mask, the rest by decode, whose matcher that first token advanced); a schema that does not
compile is a 400 with nothing held; a tool call round trip (named function, ``required`` streamed, the reply fed
back) parses into ``tool_calls``; truncation shows as ``finish_reason == "length"``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from cluster.serve import ServeConfig, ServerThread
from tests.cluster.serve.conftest import wait_idle

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "shape": {"enum": ["circle", "square", "triangle"]},
                                           "big": {"type": "boolean"},
                                           "color": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
          "required": ["count", "shape", "big", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}
ASK = [{"role": "user", "content": "Describe the shapes."}]
JSON_OBJECT_TOKENS = 64
# SCHEMA's longest reply, compact: {"count":99,"shape":"triangle","big":false,"color":"abcde"} -- 59 characters, so
# 59 tokens at most, and its end token
SCHEMA_TOKENS = 60


@pytest.fixture(scope="module")
def oai(serve_cluster):
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0))
    srv = t.start()
    yield openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="none", max_retries=0)
    t.stop()


def _schema_reply(oai, seed: int):
    return oai.chat.completions.create(
        model="duet-demo", messages=ASK, temperature=1.0, seed=seed, max_tokens=SCHEMA_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "shapes", "schema": SCHEMA}})


def test_sampled_json_schema_replies_validate(oai, serve_cluster):
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda s: _schema_reply(oai, s), range(50)))
    for r in replies:
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in replies}) > 1  # sampled, not one fixed reply
    streamed = oai.chat.completions.create(
        model="duet-demo", messages=ASK, temperature=1.0, seed=7, max_tokens=SCHEMA_TOKENS, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "shapes", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == _schema_reply(oai, 7).choices[0].message.content  # same seed, same reply, streamed or not
    wait_idle(serve_cluster)


def test_json_object_and_truncation(oai, serve_cluster):
    r = oai.completions.create(model="duet-demo", prompt="shapes:", temperature=1.0, seed=3, max_tokens=2,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "s", "schema": SCHEMA}}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")
    # the demo model either closes the object at once or writes one key string until max_tokens, whatever the
    # limit: every reply is an object from its first token, about a third of the seeds close it (they must
    # parse), and the rest are cut at the limit, not earlier
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda s: oai.chat.completions.create(
            model="duet-demo", messages=ASK, temperature=1.0, seed=s, max_tokens=JSON_OBJECT_TOKENS,
            response_format={"type": "json_object"}), range(16)))
    for r in replies:
        c = r.choices[0]
        assert c.message.content.startswith("{"), c.message.content
        if c.finish_reason == "length":
            assert r.usage.completion_tokens == JSON_OBJECT_TOKENS
        else:
            assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c
    assert sum(r.choices[0].finish_reason == "stop" for r in replies) >= 2
    wait_idle(serve_cluster)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/nowhere"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": [None]}},
], ids=["bad-type", "bad-ref", "no-schema", "unknown-format", "strict-not-boolean"])
def test_a_schema_that_does_not_compile_is_a_400_with_nothing_held(oai, serve_cluster, fmt):
    with pytest.raises(openai.BadRequestError, match="response_format|schema|compile|objekt|nowhere"):
        oai.chat.completions.create(model="duet-demo", messages=ASK, max_tokens=8, response_format=fmt)
    assert wait_idle(serve_cluster, timeout_s=1.0) < 1.0


def test_tool_call_round_trip(oai, serve_cluster):
    r = oai.chat.completions.create(model="duet-demo", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    tools=[WEATHER, CLOCK], temperature=1.0, seed=1, max_tokens=128,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result go back through the chat template
    follow = oai.chat.completions.create(
        model="duet-demo", tools=[WEATHER], max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    wait_idle(serve_cluster)


def test_required_tool_calls_streamed(oai, serve_cluster):
    stream = oai.chat.completions.create(model="duet-demo", messages=[{"role": "user", "content": "Go"}],
                                         tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
                                         temperature=1.0, seed=5, max_tokens=128, stream=True)
    calls, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].index == 0
    fn = calls[0].function
    assert fn.name in ("get_weather", "now")
    args = json.loads(fn.arguments)
    if fn.name == "get_weather":
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    else:
        assert args == {}
    wait_idle(serve_cluster)


def test_tool_request_errors_are_400s(oai):
    for kwargs, match in (({"tool_choice": "required"}, "needs 'tools'"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "not in 'tools'"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools\\[0\\]"),
                          ({"tools": [WEATHER], "tool_choice": "required",
                            "response_format": {"type": "json_object"}}, "cannot be combined")):
        with pytest.raises(openai.BadRequestError, match=match):
            oai.chat.completions.create(model="duet-demo", messages=ASK, max_tokens=4, **kwargs)
