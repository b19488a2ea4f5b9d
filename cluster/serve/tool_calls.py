"""OpenAI ``tools`` / ``tool_choice``: validated, rendered through the chat template, parsed back into ``tool_calls``.

Parsers are registered by model family (:data:`PARSERS`, :func:`parser_for`); the Qwen families (and, as the default,
any other model) use the Hermes syntax their templates teach: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>``, calls separated by a newline. ``tool_choice``:

* ``"none"``: the tools are not rendered and nothing is parsed (the reply is plain text);
* ``"auto"`` (the default with tools): rendered; the reply may be text, calls, or both;
* ``"required"``: rendered, and the output is constrained (a grammar in the structured-output mask) to one or more
  calls of the given tools, each call's arguments valid under its ``parameters`` schema (one call when
  ``parallel_tool_calls`` is false);
* ``{"type": "function", "function": {"name": N}}``: the same, exactly one call of ``N``.

A call whose JSON does not parse stays in ``content`` (as vLLM's parsers do); a finished reply with calls has
``finish_reason == "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.serve.structured import checked
from engine.errors import InvalidRequestError
from engine.grammar_spec import StructuredOutputsParams

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolRequest:
    """A request's tools (OpenAI ``function`` entries: ``{"name", "description", "parameters"}``) and choice:
    ``mode`` is none / auto / required / function (then ``name`` is the function)."""

    functions: list[dict]
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def rendered(self) -> list[dict] | None:
        """What the chat template gets as ``tools`` (OpenAI's shape), or None under ``tool_choice: none``."""
        return None if self.mode == "none" else [{"type": "function", "function": f} for f in self.functions]

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "function")

    @property
    def guarded(self) -> bool:
        """``auto`` with something to enforce: a tool marked ``strict`` (its calls' arguments follow its schema) or
        ``parallel_tool_calls: false`` (at most one call); the reply may still be plain text."""
        return self.mode == "auto" and (not self.parallel or any(f.get("strict") is True for f in self.functions))


def tools_from_body(body: dict) -> ToolRequest | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat body (None without tools); raises
    :class:`~engine.errors.InvalidRequestError` naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):  # "" or 0 is no list either
        raise InvalidRequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("'tool_choice' needs 'tools'")
        return None
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                      "with a name of letters, digits, _ . - (at most 64)")
        params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON Schema object")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("'tools' has two functions with the same name")
    req = ToolRequest(functions, parallel=parallel is not False)
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise InvalidRequestError(f"'tool_choice' names function {name!r}, which is not in 'tools'")
        req.mode, req.name = "function", name
    elif choice in (None, "auto", "none", "required"):
        req.mode = choice or "auto"
    else:
        raise InvalidRequestError("'tool_choice' must be none, auto, required or {\"type\": \"function\", ...}")
    return req


def message_tool_fields(m: dict, i: int) -> dict:
    """The tool fields of OpenAI message ``i`` as chat templates read them: an assistant's ``tool_calls`` (each
    ``{"type": "function", "function": {"name", "arguments"}}``, arguments as an object when they are JSON text,
    which is what transformers' templates expect), a tool reply's ``tool_call_id`` and ``name``."""
    out: dict = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a list")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass  # the template gets the text as it was sent
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": args}})
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def plain_tool_messages(messages: list[dict], tools: list[dict] | None, parser: HermesParser) -> list[dict]:
    """``messages`` for a template that renders no tools: the tools described in a system message (the first
    one's text follows), an assistant's calls written in its content, tool replies as user turns in
    ``<tool_response>`` tags. Unchanged when there is nothing tool-related."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")} | {"role": m["role"]}
        calls = [parser.render_call(c["function"]["name"], c["function"]["arguments"])
                 for c in messages[len(out)].get("tool_calls") or []]
        if calls:
            m["content"] = "\n".join(filter(None, [m["content"], *calls]))
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools:
        prompt = parser.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ----------------------------------------------------------------------------------------------------- parsers
@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


class HermesParser:
    """``<tool_call>{json}</tool_call>`` (Qwen2.5, Qwen3, Qwen3-VL, Hermes)."""

    start, end, sep = "<tool_call>", "</tool_call>", "\n"

    def grammar(self, req: ToolRequest) -> StructuredOutputsParams:
        """The Lark grammar (llguidance's dialect) of the calls ``req`` requires (``required`` or a named function:
        calls only), or allows (``auto`` when :attr:`ToolRequest.guarded`: any text without a call tag, or text then
        calls -- one without ``parallel_tool_calls`` -- whose arguments follow the schema of each tool marked
        ``strict``, any JSON object for the others)."""
        fns = [f for f in req.functions if req.mode != "function" or f["name"] == req.name]
        loose = req.mode == "auto"
        one = [{"type": "object", "properties": {
            "name": {"const": f["name"]},
            "arguments": f["parameters"] if not loose or f.get("strict") is True else {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        schema = {**(one[0] if len(one) == 1 else {"anyOf": one}), "x-guidance": {"whitespace_flexible": False}}
        many = req.parallel and req.mode in ("required", "auto")
        start, end = json.dumps(self.start + chr(10)), json.dumps(chr(10) + self.end)
        rest = f" (SEP {start} body {end})*" if many else ""
        if loose:  # text that never opens a call, or text up to the first call's tag (a lazy rule ending at it)
            free = f"/(?s:.*)/ & ~/(?s:.*){re.escape(self.start)}(?s:.*)/"
            lark = (f"start: TEXT | pre body {end}{rest}\nTEXT: {free}\npre[stop={start}]: TEXT\n")
        else:
            lark = f"start: {start} body {end}{rest}\n"
        lark += f"SEP: {json.dumps(self.sep)}\nbody: %json {json.dumps(schema)}\n"
        return StructuredOutputsParams(grammar=lark)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole reply; content is None when only calls remain."""
        calls, rest, pos = [], [], 0
        while (i := text.find(self.start, pos)) >= 0:
            j = text.find(self.end, i)
            body = text[i + len(self.start): j if j >= 0 else len(text)]
            call = self._call(body)
            if call is None:
                break
            rest.append(text[pos:i])
            calls.append(call)
            pos = len(text) if j < 0 else j + len(self.end)
        rest.append(text[pos:])
        content = "".join(rest).strip() if calls else "".join(rest)
        return (content or None) if calls else content, calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def render_call(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (for templates that render no ``tool_calls``)."""
        return f'{self.start}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{self.end}'

    def system_prompt(self, tools: list[dict]) -> str:
        """The tools' description for templates that render no ``tools`` (the Hermes / Qwen wording)."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


PARSERS: dict[str, HermesParser] = {"hermes": HermesParser()}
FAMILY_PARSERS = {"qwen": "hermes"}  # model_type prefix -> parser name; anything else: DEFAULT_PARSER
DEFAULT_PARSER = "hermes"


def parser_for(model_type: str) -> HermesParser:
    """The tool-call parser of a model family (its text config's ``model_type``, e.g. ``qwen3_moe``)."""
    for prefix, name in FAMILY_PARSERS.items():
        if model_type.startswith(prefix):
            return PARSERS[name]
    return PARSERS[DEFAULT_PARSER]


class ToolStream:
    """Splits a streamed reply into content deltas and whole calls: text before a call streams as it comes; from a
    call's start tag on, text is held until its end tag (or the end of the reply) and leaves as one call."""

    def __init__(self, parser: HermesParser) -> None:
        self.parser = parser
        self._held = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content delta, calls completed)`` after ``text``."""
        self._held += text
        out, done = [], []
        p = self.parser
        while True:
            i = self._held.find(p.start)
            if i < 0:
                keep = _partial_suffix(self._held, p.start)  # a start tag may be arriving
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            j = self._held.find(p.end, i)
            if j < 0:
                out.append(self._held[:i])
                self._held = self._held[i:]
                break
            call = p._call(self._held[i + len(p.start): j])
            out.append(self._held[:i] if call is not None else self._held[: j + len(p.end)])
            done += [call] if call is not None else []
            self._held = self._held[j + len(p.end):]
        self.calls += done
        content = "".join(out)
        if self.calls:
            content = content.strip("\n") if not content.strip() else content
        return content, done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is still held when the reply ends: an unterminated call that parses, else text."""
        held, self._held = self._held, ""
        p = self.parser
        if held.startswith(p.start):
            call = p._call(held[len(p.start):])
            if call is not None:
                self.calls.append(call)
                return "", [call]
        return held, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tool_parser(tools: ToolRequest | None, sampling: Any, model_type: str) -> HermesParser | None:
    """The parser of a chat reply with ``tools`` (None: plain text). Under ``required`` or a named function it
    also sets ``sampling.structured_outputs`` to the calls' grammar (checked: a 400 when a tool's ``parameters``
    do not compile, or when ``response_format`` constrains the reply too)."""
    if tools is None or tools.mode == "none":
        return None
    parser = parser_for(model_type)
    if tools.constrained or tools.guarded:
        if sampling.structured_outputs is not None:
            raise InvalidRequestError("'response_format' cannot be combined with tool_choice required or a named "
                                      "function, a strict tool or parallel_tool_calls false (both constrain the "
                                      "reply)")
        sampling.structured_outputs = checked(parser.grammar(tools))
    return parser


def reply_message(parser: HermesParser | None, text: str, finish: str) -> tuple[dict, str]:
    """A whole chat reply's ``message`` and ``finish_reason`` (``tool_calls`` when it ended with calls)."""
    if parser is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parser.parse(text)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg, "tool_calls" if calls and finish == "stop" else finish
