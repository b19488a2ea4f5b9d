"""Fuzzing of the OpenAI-compatible HTTP API from its own OpenAPI description (``GET /openapi.json``), with
schemathesis, against one front-end on the demo model (1 prefill + 1 decode over gloo).

Each endpoint gets requests that follow the description (positive: they reach the engine and generate at most
:data:`~tests.cluster.serve.fuzz_support.MAX_TOKENS` tokens) and requests that break it (negative: wrong types,
out-of-range numbers, missing fields). Every reply must be typed: no 5xx, a 4xx carries OpenAI's error body, a 200
conforms to the description (a stream ends with ``[DONE]`` and holds no server error), and a request the description
forbids is refused. After the run no worker died and no KV block is held. Example count: :mod:`.fuzz_support`.
"""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import given
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.serve.openai_requests import CHAT_FIELDS, COMPLETION_FIELDS
from cluster.serve.openapi import openapi_document
from tests.cluster.serve.fuzz_support import TOKEN, Tally, assert_cluster_clean, fuzz_settings, serving, \
    total_examples

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# (path, method, generation mode, share of the file's examples)
PLAN = [("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 0.35),
        ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 0.25),
        ("/v1/completions", "POST", GenerationMode.POSITIVE, 0.2),
        ("/v1/completions", "POST", GenerationMode.NEGATIVE, 0.15),
        ("/v1/models", "GET", GenerationMode.POSITIVE, 0.05)]
TALLY = Tally()


@pytest.fixture(scope="module")
def server(serve_cluster):
    with serving(serve_cluster, TALLY, "HTTP fuzz") as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(server):
    doc = requests.get(f"{server.http_url}/openapi.json", timeout=10).json()  # public: no token
    assert doc == openapi_document()
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearer": {"bearer": TOKEN}}}})
    return schemathesis.openapi.from_dict(doc, config=config)


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def check_reply(resp: requests.Response) -> str:
    """The invariants schemathesis' checks do not cover; returns the reply's kind for the tally."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], resp.request.body)
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["type"] != "server_error" and err["message"], err
        return f"http {resp.status_code} {err['type']}{' ' + err['code'] if err['code'] else ''}"
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in resp.text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        for ev in map(json.loads, events[:-1]):
            assert "error" not in ev or ev["error"]["type"] != "server_error", ev
        return f"http {resp.status_code} stream"
    return f"http {resp.status_code}"


@pytest.mark.parametrize("path,method,mode,share", PLAN, ids=[f"{p}-{m.value}" for p, _, m, _ in PLAN])
def test_fuzz_http(path, method, mode, share, server, schema, session, serve_cluster):
    op = schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    cases = op.as_strategy(mode)
    if mode == GenerationMode.NEGATIVE:  # bad bodies; a bad token is test_server's (a 401 reaches no validator)
        cases = cases.filter(lambda c: not c.meta.is_negative_at(ParameterLocation.HEADER))

    @fuzz_settings(round(total_examples() * share))
    @given(case=cases)
    def run(case):
        resp = case.call(base_url=server.http_url, session=session, timeout=60)
        TALLY.add(check_reply(resp))
        case.validate_response(resp, checks=checks)

    run()
    assert_cluster_clean(server, serve_cluster)


def test_the_description_is_public_and_names_every_route(server):
    resp = requests.get(f"{server.http_url}/openapi.json", timeout=10)
    assert resp.status_code == 200 and resp.json()["openapi"].startswith("3.")
    routes = {(r.method, r.resource.canonical) for r in server._runner.app.router.routes()
              if r.method in ("GET", "POST")}
    described = {(m.upper(), p) for p, ops in resp.json()["paths"].items() for m in ops}
    assert described == routes
    assert requests.get(f"{server.http_url}/v1/models", timeout=10).status_code == 401  # the rest is not public


def test_the_description_names_every_body_field_the_server_takes():
    """A field added to the server (``CHAT_FIELDS`` / ``COMPLETION_FIELDS``) must be described: keeps it in step."""
    schemas = openapi_document()["components"]["schemas"]
    assert set(schemas["ChatCompletionRequest"]["properties"]) == CHAT_FIELDS
    assert set(schemas["CompletionRequest"]["properties"]) == COMPLETION_FIELDS


# ------------------------------------------------------------------------------- regressions (bugs the fuzz found)
@pytest.mark.parametrize("body,status", [
    ({"prompt": "0", "seed": -(2 ** 63) - 1}, 400),  # msgpack could not carry it to the workers: 500
    ({"prompt": "0", "stop_token_ids": [2 ** 64]}, 400),  # likewise
    ({"prompt": "0", "top_p": 1e-300, "temperature": 1.0}, 200),  # 0 in float32: every token dropped, step failed
    ({"prompt": "0", "min_tokens": 1, "max_tokens": 2, "stop_token_ids": [100000]}, 200),  # IndexError in a step
    ({"prompt": "0", "stream": True, "stream_options": [1]}, 400),  # .get on a list: 500
    ({"prompt": "0", "stream": "yes"}, 400),  # streamed although not a boolean
    ({"prompt": "0", "echo": 0.0}, 400),  # taken although not a boolean
    ({"prompt": "0", "repetition_penalty": 5e-324, "temperature": 1.0}, 400),  # logits / subnormal = inf: 503
], ids=["seed", "stop-id", "top-p", "stop-id-vocab", "stream-options", "stream", "echo", "rep-penalty"])
def test_found_bugs_are_typed(server, session, serve_cluster, body, status):
    resp = session.post(f"{server.http_url}/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == status, resp.text
    if status == 400:
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_huge_and_empty_strings_are_typed(server, session):
    """What schemathesis does not generate: a body over the size limit (413) and empty prompts and messages (400)."""
    url, auth = f"{server.http_url}/v1/completions", {"Authorization": f"Bearer {TOKEN}"}
    for body, status in (({"prompt": "x" * 300_000}, 413), ({"prompt": ""}, 400), ({"prompt": " " * 1000}, 400),
                         ({"prompt": "y " * 5000}, 400)):  # the last: over max_prompt_tokens
        resp = session.post(url, json=body, headers=auth, timeout=60)
        assert resp.status_code == status and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    resp = session.post(f"{server.http_url}/v1/chat/completions", headers=auth, timeout=60,
                        json={"messages": [{"role": "user", "content": ""}]})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "the prompt is empty"
