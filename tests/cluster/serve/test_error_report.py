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
