"""Fuzzing of the OpenAI-compatible HTTP API from its own OpenAPI description (``GET /openapi.json``), with
schemathesis, against one front-end on the demo model (1 prefill + 1 decode over gloo).

Each endpoint gets requests that follow the description (positive: they reach the engine and generate at most
:data:`~tests.cluster.serve.fuzz_support.MAX_TOKENS` tokens) and requests that break it (negative: wrong types,
out-of-range numbers, missing fields). Every reply must be typed: no 5xx, a 4xx carries OpenAI's error body, a 200
conforms to the description and is whole (a choice per ``n``, each finished, usage that adds up; a stream ends with
``[DONE]`` and holds no server error), and a request the description forbids is refused. A positive request is
served, unless it breaks one of the rules the description cannot state (:data:`BEYOND_THE_DESCRIPTION`); some
are (all, for :data:`ALL_SERVED`). After the run no worker died and no KV block is held. Example count:
:mod:`.fuzz_support`.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
import schemathesis
from hypothesis import example, given
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.serve.openai_requests import CHAT_FIELDS, COMPLETION_FIELDS
from cluster.serve.openapi import openapi_document
from tests.cluster.serve.fuzz_support import MAX_TOKENS, TOKEN, Tally, assert_cluster_clean, fuzz_settings, \
    serving, total_examples

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# (path, method, generation mode, share of the file's examples)
PLAN = [("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 0.35),
        ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 0.25),
        ("/v1/completions", "POST", GenerationMode.POSITIVE, 0.2),
        ("/v1/completions", "POST", GenerationMode.NEGATIVE, 0.15),
        ("/v1/models", "GET", GenerationMode.POSITIVE, 0.05)]
TALLY = Tally()
# why a request that follows the description may still be a 400: relations between fields, the server's limits, the
# model's vocabulary and name, a data: URL with no MIME type or base64, and JSON Schema's integers, which take 1.0
# (the server takes only JSON integers). A positive request refused for anything else fails the test.
BEYOND_THE_DESCRIPTION = re.compile("|".join([
    r"^the prompt is empty$", r"needs 'logprobs': true", r"'stream_options' is only allowed with stream: true",
    r"'tool_choice' needs 'tools'", r"which is not in 'tools'", r"'tools' has two functions with the same name",
    r"^min_tokens must be in \[0, max_tokens\]", r"over this server's limit", r"^prompt has \d+ tokens; ",
    r"^token id \d+ is outside the vocabulary", r"is not served here", r"content\[\d+\]: expected data:",
    r"has the wrong type \(float\)", r"'stop_token_ids' must be a list of integers",
    r"^'prompt' must be a string or a list of token ids"]))
ALL_SERVED = {"/v1/models"}  # no rule beyond the description: every positive request is served
# one request that must be served, beside the generated ones: the generated sequence varies between runs (set order
# follows hash randomization) and most generated chats break a rule above, so a run may draw none that is served
SERVABLE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": MAX_TOKENS},
            "/v1/completions": {"prompt": "Hello", "max_tokens": MAX_TOKENS}}


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


def check_reply(resp: Response) -> str:
    """The invariants schemathesis' checks do not cover; returns the reply's kind for the tally."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], resp.request.body)
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["type"] != "server_error" and err["message"], err
        return f"http {resp.status_code} {err['type']}{' ' + err['code'] if err['code'] else ''}"
    if resp.headers.get("content-type", [""])[0].startswith("text/event-stream"):  # lowercase keys, list values
        events = [line[len("data: "):] for line in resp.text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        chunks = [json.loads(ev) for ev in events[:-1]]
        for ev in chunks:
            assert "error" not in ev or ev["error"]["type"] != "server_error", ev
        if not any("error" in ev for ev in chunks):
            check_stream(resp, chunks)
        return f"http {resp.status_code} stream"
    if resp.request.method == "POST":
        check_completion(resp, resp.json())
    else:
        assert "duet-demo" in {m["id"] for m in resp.json()["data"]}, resp.text
    return f"http {resp.status_code}"


def _choices_asked(resp: Response) -> int:
    return json.loads(resp.request.body).get("n") or 1


def check_completion(resp: Response, body: dict) -> None:
    """A served completion is whole: a choice per ``n``, each finished, and usage that adds up."""
    n = _choices_asked(resp)
    assert sorted(c["index"] for c in body["choices"]) == list(range(n)), body
    assert all(c["finish_reason"] for c in body["choices"]), body
    use = body["usage"]
    assert use["prompt_tokens"] > 0 and 0 < use["completion_tokens"] <= n * MAX_TOKENS, body
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"], body


def check_stream(resp: Response, chunks: list[dict]) -> None:
    """A served stream is whole: every choice of ``n`` ends with a finish reason (once)."""
    finished = [c["index"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")]
    assert sorted(finished) == list(range(_choices_asked(resp))), chunks


@pytest.mark.parametrize("path,method,mode,share", PLAN, ids=[f"{p}-{m.value}" for p, _, m, _ in PLAN])
def test_fuzz_http(path, method, mode, share, server, schema, session, serve_cluster):
    op = schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    cases = op.as_strategy(mode)
    if mode == GenerationMode.NEGATIVE:  # bad bodies; a bad token is test_server's (a 401 reaches no validator)
        cases = cases.filter(lambda c: not c.meta.is_negative_at(ParameterLocation.HEADER))

    sent = served = 0

    @fuzz_settings(round(total_examples() * share))
    @given(case=cases)
    def run(case):
        nonlocal sent, served
        resp = case.call(base_url=server.http_url, session=session, timeout=60)
        TALLY.add(check_reply(resp))
        case.validate_response(resp, checks=checks)
        sent, served = sent + 1, served + (resp.status_code == 200)
        if mode == GenerationMode.POSITIVE and resp.status_code != 200:
            assert BEYOND_THE_DESCRIPTION.search(resp.json()["error"]["message"]), (resp.text, resp.request.body)

    if mode == GenerationMode.POSITIVE and path in SERVABLE:
        run = example(case=op.Case(body=SERVABLE[path], media_type="application/json",
                                   headers={"Authorization": f"Bearer {TOKEN}"}))(run)
    run()
    if mode == GenerationMode.POSITIVE:
        # most generated chats break a rule above (an empty prompt, an image that is not one): a few are served
        assert served == sent if path in ALL_SERVED else served > 0, f"{served} of {sent} positive requests served"
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
