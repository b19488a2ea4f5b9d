"""Decode events (:mod:`node_common.events`): both kinds round-trip through their wire maps (and msgpack, as they
travel); another version, an unknown kind or a malformed map is a typed :class:`EventError`, never a guess."""

from __future__ import annotations

import msgpack
import pytest

from node_common.events import EVENT_VERSION, EventError, RequestFailed, TokenEvent, event_from_wire

FULL = TokenEvent("r1", 1, [5, 6], finished=True, choice_finished=True, finish_reason="length",
                  logprobs=[{"token": 5, "logprob": -0.5}], prompt_logprobs=[None, {"token": 3, "logprob": -1.0}],
                  expert_hist=[[1, 0], [0, 1]], kv_transfer={"transport": "inproc", "bytes": 64})


def _over_msgpack(d: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)


@pytest.mark.parametrize("event", [TokenEvent("r0", 0, [1, 2, 3]), FULL, RequestFailed("r2", "TransferTimeout: x")],
                         ids=["tokens-minimal", "tokens-full", "failed"])
def test_round_trip(event):
    wire = event.to_wire()
    assert wire["v"] == EVENT_VERSION and wire["kind"] == event.kind
    assert event_from_wire(_over_msgpack(wire)) == event


def test_token_wire_keys():
    assert set(TokenEvent("r", 0, [1]).to_wire()) == {"v", "kind", "request_id", "index", "token_ids", "finished",
                                                       "choice_finished", "finish_reason"}
    assert set(FULL.to_wire()) >= {"logprobs", "prompt_logprobs", "expert_hist", "kv_transfer"}
    assert RequestFailed("r", "why").to_wire() == {"v": EVENT_VERSION, "kind": "failed", "request_id": "r",
                                                   "reason": "why", "retryable": True}


def test_failed_retryable_round_trips_and_defaults_to_true():
    for retryable in (True, False):
        assert event_from_wire(RequestFailed("r", "why", retryable=retryable).to_wire()).retryable is retryable
    older = {"v": EVENT_VERSION, "kind": "failed", "request_id": "r", "reason": "why"}  # a sender without the field
    assert event_from_wire(older).retryable is True
    with pytest.raises(EventError):
        event_from_wire({**older, "retryable": "no"})


@pytest.mark.parametrize("version", [None, 0, EVENT_VERSION + 1, "1"])
def test_other_version_is_refused(version):
    wire = {**TokenEvent("r", 0, [1]).to_wire(), "v": version}
    with pytest.raises(EventError, match="version"):
        event_from_wire(wire)


def test_unknown_kind_is_refused():
    with pytest.raises(EventError, match="unknown decode event kind 'bogus'"):
        event_from_wire({**TokenEvent("r", 0, [1]).to_wire(), "kind": "bogus"})


@pytest.mark.parametrize("wire", [
    {"v": EVENT_VERSION, "kind": "tokens", "request_id": "r", "index": 0, "finished": False},  # no token_ids
    {**TokenEvent("r", 0, [1]).to_wire(), "token_ids": ["x"]},
    {**TokenEvent("r", 0, [1]).to_wire(), "index": None},
    {"v": EVENT_VERSION, "kind": "failed", "request_id": "r"},  # no reason
    {"v": EVENT_VERSION, "request_id": "r"},  # no kind
], ids=["missing-tokens", "bad-token", "bad-index", "failed-no-reason", "no-kind"])
def test_malformed_map_is_refused(wire):
    with pytest.raises(EventError, match="malformed"):
        event_from_wire(wire)


@pytest.mark.parametrize("wire", [None, [], "tokens", 3])
def test_not_a_map_is_refused(wire):
    with pytest.raises(EventError):
        event_from_wire(wire)


def test_event_error_is_a_registered_duet_error():
    from engine.errors import DuetError

    assert issubclass(EventError, DuetError) and EventError.code == "event"
