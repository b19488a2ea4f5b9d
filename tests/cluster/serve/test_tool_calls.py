"""Tool-call parsing, streaming split and rendering (pure: no cluster)."""

from __future__ import annotations

import copy
import json

import pytest

from cluster.demo import default_model_dir
from cluster.serve.chat import render_chat
from cluster.serve.openai_requests import chat_from_body
from cluster.serve.tool_calls import ToolStream, parser_for, tools_from_body
from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.grammar import validate
from engine.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_hermes_parse_splits_content_and_calls():
    p = parser_for("qwen3_moe")
    content, calls = p.parse(REPLY)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                  ("get_weather", {"city": "Rome"})]
    assert p.parse("no calls here") == ("no calls here", [])
    broken = '<tool_call>\n{"name": "get_weather", "argu'
    assert p.parse(broken) == (broken, [])  # an unparsable call stays text
    assert p.parse('<tool_call>{"name": "now", "arguments": {}}')[1][0].name == "now"  # unterminated but whole


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_split_equals_the_whole_parse(step):
    s = ToolStream(parser_for("qwen2"))
    content, calls = [], []
    for i in range(0, len(REPLY), step):
        text, done = s.push(REPLY[i:i + step])
        content.append(text)
        calls += done
    text, done = s.finish()
    content.append(text)
    calls += done
    assert "".join(content).strip() == "Let me check."
    assert [c.arguments for c in calls] == [c.arguments for c in parser_for("qwen2").parse(REPLY)[1]]
    assert "<tool" not in "".join(content)


def test_tool_choice_grammar_compiles_and_names_the_function():
    req = tools_from_body({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                               "function": {"name": "get_weather"}}})
    assert req.mode == "function" and req.name == "get_weather" and req.constrained
    spec = parser_for("qwen3").grammar(req)
    validate(spec)
    assert "get_weather" in spec.grammar and "(SEP " not in spec.grammar  # exactly one call
    many = parser_for("qwen3").grammar(tools_from_body({"tools": [WEATHER], "tool_choice": "required"}))
    assert "(SEP " in many.grammar
    assert tools_from_body({"tools": [WEATHER], "tool_choice": "none"}).rendered is None
    assert tools_from_body({}) is None


def _demo() -> tuple[Tokenizer, ModelConfig]:
    return Tokenizer.from_pretrained(default_model_dir()), ModelConfig.from_pretrained(default_model_dir())


def test_a_template_with_tools_gets_them_and_the_calls():
    tok, cfg = _demo()
    tok = copy.copy(tok)
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "({{ c.function.name }} {{ c.function.arguments.city }}){% endfor %};{% endfor %}")
    messages, _ = chat_from_body({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    text = render_chat(tok, cfg, messages, [WEATHER])
    assert text == "[get_weather]user:hi;assistant:(get_weather Oslo);tool:sunny;"


def test_a_template_without_tools_gets_them_in_the_model_syntax():
    tok, cfg = _demo()
    assert "tools" not in tok.chat_template
    messages, _ = chat_from_body({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]})
    text = render_chat(tok, cfg, messages, [WEATHER])
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, cfg, plain) == tok.apply_chat_template(plain)  # no tools: unchanged


@pytest.mark.parametrize("body", [{"tools": ""}, {"tools": 0}, {"tools": {}}, {"tools": False},
                                  {"tools": [WEATHER], "parallel_tool_calls": "yes"},
                                  {"parallel_tool_calls": 1}],
                         ids=["empty-string", "zero", "object", "false", "parallel-string", "parallel-without-tools"])
def test_falsy_or_mistyped_tool_fields_are_refused_not_ignored(body):
    """``tools`` that is no list (an empty string included) and a non-boolean ``parallel_tool_calls`` are 400s
    (the HTTP fuzz's negative mode sent ``"tools": ""`` and got a 200); absent or an empty list means no tools."""
    with pytest.raises(InvalidRequestError):
        tools_from_body(body)
    assert tools_from_body({"tools": []}) is None and tools_from_body({"tools": None}) is None


def _matcher_run(grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, the grammar complete after it) under the demo tokenizer."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), llguidance.grammar_from("lark", grammar), log_level=0)
    ok = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok, ok and m.is_accepting()


def _call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, separators=(',', ':'))}\n</tool_call>"


STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True,
                                           "parameters": {**WEATHER["function"]["parameters"],
                                                          "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}}, "required": ["text"]}}}


def test_auto_with_a_strict_tool_allows_text_and_holds_calls_to_its_schema():
    """tool_choice auto, a tool marked strict: the reply may be plain text, or text then calls, and a strict tool's
    arguments must follow its schema (a non-strict tool's may be any object); the grammar used to be skipped in auto
    mode, so strict was accepted and ignored."""
    req = tools_from_body({"tools": [STRICT, LOOSE]})
    assert req.mode == "auto" and req.guarded and not req.constrained
    g = parser_for("qwen3").grammar(req).grammar
    validate(parser_for("qwen3").grammar(req))
    assert _matcher_run(g, "No tool needed: it is sunny.") == (True, True)
    good = _call("get_weather", {"city": "Oslo"})
    assert _matcher_run(g, f"Let me check.\n{good}") == (True, True)
    assert _matcher_run(g, f"{good}\n{_call('note', {'anything': [1, 2]})}") == (True, True)  # not strict
    assert _matcher_run(g, f"Let me check.\n{_call('get_weather', {'town': 'Oslo'})}")[0] is False
    assert _matcher_run(g, _call("get_weather", {"city": 7}))[0] is False
    assert _matcher_run(g, _call("unknown_tool", {}))[0] is False


def test_auto_without_parallel_calls_allows_one_call_at_most():
    req = tools_from_body({"tools": [WEATHER], "parallel_tool_calls": False})
    assert req.guarded
    g = parser_for("qwen3").grammar(req).grammar
    one = _call("get_weather", {"city": "Oslo"})
    assert _matcher_run(g, f"Sure.\n{one}") == (True, True)
    assert _matcher_run(g, f"{one}\n{one}")[0] is False
    assert _matcher_run(g, "plain text") == (True, True)
    assert not tools_from_body({"tools": [WEATHER]}).guarded  # auto, nothing strict, parallel: unconstrained


def test_a_guarded_auto_reply_cannot_also_take_response_format():
    from cluster.serve.tool_calls import tool_parser
    from engine import SamplingParams
    from engine.grammar_spec import StructuredOutputsParams

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidRequestError, match="strict tool"):
        tool_parser(tools_from_body({"tools": [STRICT]}), sp, "qwen3")
    plain = SamplingParams()
    assert tool_parser(tools_from_body({"tools": [STRICT]}), plain, "qwen3") is not None
    assert plain.structured_outputs is not None
