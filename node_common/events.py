"""What a decode worker reports to the front-end about its requests: typed, versioned events.

A decode worker's ``poll`` returns ``{"events": [event wire map, ...], "free_blocks": n}`` (:mod:`node_common.messages`)
holding every event produced since the last poll, for all its requests. Two kinds, told apart by ``"kind"``:

* :class:`TokenEvent` -- new tokens of one choice of one request (``index``), in order. ``finished`` is set on the
  request's last event only (every choice ended): a consumer stops reading that request there. ``choice_finished``
  and ``finish_reason`` are the choice's own. ``logprobs`` (when asked) has one wire entry per new token
  (:meth:`engine.outputs.TokenLogprobs.to_wire`); ``prompt_logprobs`` (when asked) comes on choice 0's first event,
  one entry per prompt token (None for the first); ``expert_hist`` (prefill's routing histogram) and
  ``kv_transfer`` (the hand-off's figures) on choice 0's first event.
* :class:`RequestFailed` -- the request failed on the worker (its transfer, its step); the worker holds nothing of it
  any more. The front-end turns it into a typed exception: a retry on another pair, or -- ``retryable`` false: the
  request's own fault in a step (:mod:`engine.isolation`), which another pair would meet too -- the client's
  :class:`~engine.isolation.RequestFailedError`.

Every wire map carries ``"v": EVENT_VERSION``; :func:`event_from_wire` raises :class:`EventError` for another version,
an unknown kind or a malformed map, so a consumer never reads a field by guesswork.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import DuetError

EVENT_VERSION = 1


class EventError(DuetError):
    """A decode event could not be decoded (wrong version, unknown kind, or a malformed map)."""

    code = "event"


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    index: int  # the choice (0 unless n > 1)
    token_ids: list[int]  # new since this choice's previous event
    finished: bool = False  # the request's last event (every choice ended)
    choice_finished: bool = False
    finish_reason: str | None = None  # the choice's, once it ended
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    expert_hist: list | None = None
    kv_transfer: dict | None = None

    kind = "tokens"

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": EVENT_VERSION, "kind": self.kind, "request_id": self.request_id,
                               "index": self.index, "token_ids": list(self.token_ids), "finished": self.finished,
                               "choice_finished": self.choice_finished, "finish_reason": self.finish_reason}
        for name in ("logprobs", "prompt_logprobs", "expert_hist", "kv_transfer"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    reason: str  # one line for logs and the client's message
    retryable: bool = True  # False: the request's own fault (absent on the wire: True)
    extra: dict = field(default_factory=dict)  # reserved for additive fields of later versions

    kind = "failed"

    def to_wire(self) -> dict[str, Any]:
        return {"v": EVENT_VERSION, "kind": self.kind, "request_id": self.request_id, "reason": self.reason,
                "retryable": self.retryable}


DecodeEvent = TokenEvent | RequestFailed


def event_from_wire(d: Any) -> DecodeEvent:
    """Inverse of ``to_wire`` for either kind; raises :class:`EventError` for anything else."""
    if not isinstance(d, dict) or d.get("v") != EVENT_VERSION:
        got = d.get("v") if isinstance(d, dict) else type(d).__name__
        raise EventError(f"decode event version {got!r} is not supported (expected {EVENT_VERSION})")
    try:
        if d["kind"] == TokenEvent.kind:
            return TokenEvent(request_id=str(d["request_id"]), index=int(d["index"]),
                              token_ids=[int(t) for t in d["token_ids"]], finished=bool(d["finished"]),
                              choice_finished=bool(d["choice_finished"]), finish_reason=d["finish_reason"],
                              logprobs=d.get("logprobs"), prompt_logprobs=d.get("prompt_logprobs"),
                              expert_hist=d.get("expert_hist"), kv_transfer=d.get("kv_transfer"))
        if d["kind"] == RequestFailed.kind:
            retryable = d.get("retryable", True)
            if not isinstance(retryable, bool):
                raise TypeError(f"retryable must be a bool, got {retryable!r}")
            return RequestFailed(request_id=str(d["request_id"]), reason=str(d["reason"]), retryable=retryable)
    except (KeyError, TypeError, ValueError) as e:
        raise EventError(f"malformed decode event: {e!r}") from None
    raise EventError(f"unknown decode event kind {d.get('kind')!r}")
