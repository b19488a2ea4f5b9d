"""How failures are reported (:func:`cluster.serve.errors.classify`)."""

from __future__ import annotations

import grpc

from cluster.serve.errors import classify
from decode_node.expert_group import GroupUnavailable


def test_a_retryable_error_that_outlived_the_retry_is_unavailable_not_internal():
    # found by the chaos soak: SIGKILL of a member of the only expert-parallel group failed the request on both
    # tries with GroupUnavailable, which reached clients as INTERNAL / 500 while the group was being re-formed
    info = classify(GroupUnavailable("expert-parallel group broke"))
    assert (info.grpc_code, info.http_status, info.outcome) == (grpc.StatusCode.UNAVAILABLE, 503, "unavailable")
    assert classify(RuntimeError("boom")).grpc_code == grpc.StatusCode.INTERNAL


def test_an_aborted_http_reply_is_an_error_not_a_natural_stop():
    """A reply cut short (drain past its timeout, a cancel) used to be a 200 with finish_reason "stop"; now the
    OpenAI front-end raises a typed error: 503 with code request_aborted (in-band in a stream), retryable by the
    client. The natural reasons pass through."""
    import pytest

    from cluster.serve.openai_api import _finish
    from engine.errors import RequestAbortedError

    assert [_finish(r) for r in ("stop", "length")] == ["stop", "length"]
    with pytest.raises(RequestAbortedError) as e:
        _finish("abort")
    info = classify(e.value)
    assert (info.grpc_code, info.http_status, info.openai_code) == (grpc.StatusCode.UNAVAILABLE, 503,
                                                                     "request_aborted")


def test_a_prefill_refusal_is_429_with_retry_after_resource_exhausted_with_the_hint_and_counted():
    """:class:`PrefillOverloadedError` end to end without a server: HTTP 429 with ``Retry-After`` (whole seconds, at
    least 1) and code prefill_overloaded; gRPC RESOURCE_EXHAUSTED with ``retry-after-ms``, which the client SDK
    turns into :class:`ResourceExhausted` with ``retry_after_s``; one ``duet_requests_refused_total`` by reason (a
    timeout is not a refusal)."""
    import asyncio
    import json

    from cluster.control.errors import PrefillOverloadedError, RequestTimeoutError
    from cluster.serve.grpc_api import _abort_with
    from cluster.serve.metrics import Metrics
    from cluster.serve.openai_api import error_response
    from duet_client.errors import ResourceExhausted, from_status

    e = PrefillOverloadedError("request r: the prefill workers would get to its first token in about 9.0 s",
                               retry_after_s=2.6)
    info = classify(e)
    assert (info.grpc_code, info.http_status, info.openai_code, info.retry_after_s) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "prefill_overloaded", 2.6)

    r = error_response(e)
    assert (r.status, r.headers["Retry-After"]) == (429, "3")
    assert json.loads(r.body)["error"] == {"message": str(e), "type": "rate_limit_error", "param": None,
                                           "code": "prefill_overloaded"}

    aborted: list[tuple] = []

    class _Context:
        async def abort(self, code, details, trailing_metadata=()):
            aborted.append((code, details, trailing_metadata))

    asyncio.run(_abort_with(_Context(), e))
    got = from_status(*aborted[0])
    assert isinstance(got, ResourceExhausted) and got.retry_after_s == 2.6 and "9.0 s" in got.details

    m = Metrics(lambda: [], lambda: 0)
    m.observe_error(info)
    m.observe_error(classify(RequestTimeoutError("late")))
    refused = [ln for ln in m.render().decode().splitlines() if ln.startswith("duet_requests_refused_total")]
    assert refused == ['duet_requests_refused_total{reason="prefill_overloaded"} 1.0']
