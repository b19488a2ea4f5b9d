"""What the client returns: token deltas while streaming, and the whole completion with usage and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet_client._proto.duet.v1 import duet_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True)
class Delta:
    """Tokens generated since the previous delta, and their text."""

    token_ids: list[int]
    text: str


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass
class Completion:
    """A finished request: the whole text and tokens, why it stopped, usage, and where its time went.

    ``timeline`` has ``queue_seconds, preprocess_seconds, prefill_seconds, decode_seconds, ttft_seconds,
    total_seconds, attempts, prefill_worker, decode_worker`` and ``kv_transfer`` (``transport, bytes, wire_bytes,
    layers, seconds, exposed_seconds``); ``vision_encode_seconds`` only when the server reports it.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop: str = ""  # the stop string that ended it, if any
    usage: Usage = field(default_factory=Usage)
    timeline: dict = field(default_factory=dict)


class CompletionBuilder:
    """Accumulates a Generate stream's responses into deltas and the final :class:`Completion`."""

    def __init__(self) -> None:
        self.completion = Completion(request_id="")
        self.finished = False

    @property
    def started(self) -> bool:
        """A token (or the final message) arrived: the request can no longer be retried transparently."""
        return self.finished or bool(self.completion.token_ids)

    def add(self, resp: pb.GenerateResponse) -> Delta | None:
        """Fold one response in; returns the delta to hand to the caller (None for the final message)."""
        c = self.completion
        c.request_id = resp.request_id or c.request_id
        if resp.WhichOneof("kind") == "delta":
            ids, text = list(resp.delta.token_ids), resp.delta.text
            c.token_ids.extend(ids)
            c.text += text
            return Delta(ids, text)
        f = resp.final
        self.finished = True
        c.finish_reason = FINISH_REASONS.get(f.finish_reason)
        c.stop = f.stop
        c.usage = Usage(f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.total_tokens)
        c.timeline = timeline_to_dict(f.timeline)
        return None


def message_to_dict(m) -> dict:
    """A message's fields as plain Python values (64-bit ints stay ints, unlike ``json_format``); enums become
    their names, unset ``optional`` scalars are left out, nested messages become dicts."""
    out: dict = {}
    for f in m.DESCRIPTOR.fields:
        if f.is_repeated:
            out[f.name] = [message_to_dict(v) if f.message_type is not None else v for v in getattr(m, f.name)]
        elif f.message_type is not None:
            out[f.name] = message_to_dict(getattr(m, f.name))
        elif f.enum_type is not None:
            out[f.name] = f.enum_type.values_by_number[getattr(m, f.name)].name
        elif not f.has_presence or m.HasField(f.name):
            out[f.name] = getattr(m, f.name)
    return out


def timeline_to_dict(t: pb.Timeline) -> dict:
    return message_to_dict(t)
