"""What the client returns: token deltas while streaming, and the whole completion with usage and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet_client._proto.duet.v1 import duet_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
                  pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}


@dataclass(frozen=True)
class ToolCall:
    """A call of one of the request's tools, parsed from the reply: ``arguments`` is JSON text (OpenAI's
    ``function.arguments``). Send it back in the next request's assistant turn (``tool_calls=[call]``) and answer
    it with a ``{"role": "tool", "tool_call_id": call.id, "content": ...}`` turn."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """As OpenAI's ``message.tool_calls`` entries."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the distribution it was sampled from, and the ``top`` most likely tokens'
    ``(token_id, logprob)``, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """Tokens of choice ``index`` generated since its previous delta, their text, and their logprobs when asked."""

    token_ids: list[int]
    text: str
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Choice:
    """One of ``n`` choices of a finished request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls"
    stop: str = ""
    logprobs: list[TokenLogprob] | None = None
    # A request with tools: the calls parsed from text; content is text without them (None when only calls remain).
    # Without tools: no calls, and content is text.
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


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
    layers, seconds, exposed_seconds``, and for hybrid models ``state_bytes, state_frames``: the GDN state moved
    beside the KV); ``vision_encode_seconds`` only when the server reports it; ``ttft_breakdown``: the time to first
    token in consecutive stages (``frontend_queue_seconds, decode_allocate_seconds, prefill_submit_seconds,
    prefill_queue_seconds, vision_encode_seconds, prefill_compute_seconds, transfer_exposed_seconds,
    decode_commit_seconds, first_token_streamed_seconds``; they add up to ``ttft_seconds``).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls" (it ended with tool calls)
    stop: str = ""  # the stop string that ended it, if any
    usage: Usage = field(default_factory=Usage)
    timeline: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # choice 0's, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens after the first, when asked
    choices: list[Choice] = field(default_factory=list)  # every choice (text, token_ids, ... above: choice 0's)
    tool_calls: list[ToolCall] = field(default_factory=list)  # choice 0's (see Choice)
    content: str | None = None  # choice 0's (see Choice)


class CompletionBuilder:
    """Accumulates a Generate stream's responses into deltas and the final :class:`Completion`."""

    def __init__(self) -> None:
        self.completion = Completion(request_id="")
        self.finished = False
        self._choices: dict[int, Choice] = {}

    @property
    def started(self) -> bool:
        """A token (or the final message) arrived: the request can no longer be retried transparently."""
        return self.finished or any(ch.token_ids for ch in self._choices.values())

    def add(self, resp: pb.GenerateResponse) -> Delta | None:
        """Fold one response in; returns the delta to hand to the caller (None for the final message)."""
        c = self.completion
        c.request_id = resp.request_id or c.request_id
        if resp.WhichOneof("kind") == "delta":
            d = resp.delta
            ids, text = list(d.token_ids), d.text
            lps = _logprobs(d.logprobs)
            if d.prompt_logprobs:
                c.prompt_logprobs = _logprobs(d.prompt_logprobs)
            choice = self._choices.setdefault(d.index, Choice(d.index))
            choice.token_ids.extend(ids)
            choice.text += text
            if lps:
                choice.logprobs = (choice.logprobs or []) + lps
            if d.index == 0:
                c.token_ids, c.text, c.logprobs = choice.token_ids, choice.text, choice.logprobs
            return Delta(ids, text, d.index, lps)
        f = resp.final
        self.finished = True
        c.finish_reason = FINISH_REASONS.get(f.finish_reason)
        c.stop = f.stop
        for end in f.choices:  # an api_version-1 server sends none: choice 0 is the request
            choice = self._choices.setdefault(end.index, Choice(end.index))
            choice.finish_reason, choice.stop = FINISH_REASONS.get(end.finish_reason), end.stop
            choice.tool_calls = [ToolCall(t.id, t.name, t.arguments) for t in end.tool_calls]
            if end.HasField("content"):  # the server parsed the text for tool calls
                choice.content = end.content if end.content or not choice.tool_calls else None
        c.choices = [self._choices[i] for i in sorted(self._choices)] or [Choice(0)]
        if not f.choices:
            c.choices[0].finish_reason, c.choices[0].stop = c.finish_reason, c.stop
        for choice in c.choices:
            if not choice.tool_calls and choice.content is None:
                choice.content = choice.text
        c.tool_calls, c.content = c.choices[0].tool_calls, c.choices[0].content
        c.usage = Usage(f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.total_tokens)
        c.timeline = timeline_to_dict(f.timeline)
        return None


def _logprobs(msgs) -> list[TokenLogprob] | None:
    return [TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in msgs] or None


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
