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
    assert "get_weather" in spec.grammar and "(SEP call)*" not in spec.grammar  # exactly one call
    many = parser_for("qwen3").grammar(tools_from_body({"tools": [WEATHER], "tool_choice": "required"}))
    assert "(SEP call)*" in many.grammar
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
