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
