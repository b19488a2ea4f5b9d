"""The committed ``duet.v1`` stubs are what ``scripts/gen_protos.py`` makes from ``protos/``, and the client SDK
imports without torch or Ray (it ships on its own with grpcio + protobuf)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date():
    pytest.importorskip("grpc_tools")
    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=REPO, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr


def test_client_sdk_imports_without_torch_or_ray():
    code = ("import sys, duet_client, duet_client.cli; "
            "heavy = [m for m in ('torch', 'ray', 'numpy', 'PIL', 'engine', 'cluster') if m in sys.modules]; "
            "print(heavy); sys.exit(bool(heavy))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_request_building():
    from duet_client.request import build_request, sniff_mime

    png = (REPO / "examples" / "shapes.png").read_bytes()
    req = build_request("<image>hi", images=[png, REPO / "examples" / "shapes.png"], max_tokens=5, stop=",",
                        temperature=0.0, request_id="r1")
    assert req.prompt == "<image>hi" and [i.mime_type for i in req.images] == ["image/png"] * 2
    assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")
    assert list(req.sampling.stop) == [","] and req.request_id == "r1" and req.api_version == 2  # no v3 field
    assert build_request([1, 2, 3]).prompt_token_ids.ids == [1, 2, 3]
    assert build_request(messages=[{"role": "user", "content": "x"}]).WhichOneof("input") == "chat"
    assert sniff_mime(b"\xff\xd8\xff\xe0") == "image/jpeg" and sniff_mime(b"??") == ""
    with pytest.raises(TypeError, match="an image must be bytes"):
        build_request("x", images=[42])
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        build_request()


def test_response_format_and_tools_build_version_3_requests():
    import json

    from duet_client.request import API_VERSION, BASE_VERSION, build_request

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    weather = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": schema}}
    plain = build_request(messages=[{"role": "user", "content": "x"}])
    assert plain.api_version == BASE_VERSION == 2 and not plain.HasField("response_format")  # a v2 server takes it
    req = build_request(messages=[{"role": "user", "content": "x"}], tools=[weather], parallel_tool_calls=False,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                                "strict": True}})
    assert req.api_version == API_VERSION == 3
    f = req.response_format
    assert (f.type, json.loads(f.schema), f.name, f.strict) == ("json_schema", schema, "s", True)
    t = req.tools[0]
    assert (t.name, t.description, json.loads(t.parameters), t.HasField("strict")) == ("get_weather", "d", schema,
                                                                                       False)
    assert req.tool_choice == "get_weather" and req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    assert build_request("x", response_format={"type": "json_object"}).api_version == 3
    assert build_request(messages=[{"role": "user", "content": "x"}], tool_choice="none").tool_choice == "none"
    turn = build_request(messages=[
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]).chat.messages
    assert turn[0].content == "" and json.loads(turn[0].tool_calls[0].arguments) == {"a": 1}
    assert turn[1].tool_call_id == "call_1"
    with pytest.raises(ValueError, match="'logit_bias', which duet.v1 does not carry"):
        build_request("x", response_format={"type": "json_object", "logit_bias": {}})
    with pytest.raises(ValueError, match="a tool must be"):
        build_request(messages=[{"role": "user", "content": "x"}], tools=[{"type": "retrieval"}])
    with pytest.raises(ValueError, match="tool_choice must be"):
        build_request(messages=[{"role": "user", "content": "x"}], tools=[weather], tool_choice={"type": "x"})


def test_final_tool_calls_and_content_fold_into_the_completion():
    from duet_client._proto.duet.v1 import duet_pb2 as pb
    from duet_client.types import CompletionBuilder, ToolCall

    def fold(final: pb.GenerateFinal, text: str = "raw"):
        b = CompletionBuilder()
        b.add(pb.GenerateResponse(request_id="r", delta=pb.TokenDelta(token_ids=[1], text=text)))
        b.add(pb.GenerateResponse(request_id="r", final=final))
        return b.completion

    call = pb.ToolCall(id="call_1", name="f", arguments='{"a": 1}')
    c = fold(pb.GenerateFinal(finish_reason=pb.FINISH_REASON_TOOL_CALLS, choices=[pb.ChoiceFinal(
        index=0, finish_reason=pb.FINISH_REASON_TOOL_CALLS, tool_calls=[call], content="")]))
    assert c.finish_reason == c.choices[0].finish_reason == "tool_calls" and c.text == "raw"
    assert c.tool_calls == [ToolCall("call_1", "f", '{"a": 1}')] and c.content is None  # only calls: as OpenAI's
    assert c.tool_calls[0].openai()["function"] == {"name": "f", "arguments": '{"a": 1}'}
    c = fold(pb.GenerateFinal(choices=[pb.ChoiceFinal(index=0, tool_calls=[call], content="Let me see.")]))
    assert c.content == "Let me see."
    c = fold(pb.GenerateFinal(finish_reason=pb.FINISH_REASON_STOP, choices=[pb.ChoiceFinal(index=0)]))
    assert c.tool_calls == [] and c.content == "raw"  # no tools: the content is the text
    c = fold(pb.GenerateFinal(choices=[pb.ChoiceFinal(index=0, content="")]), text="")
    assert c.content == ""  # parsed, no calls, nothing written: "" as HTTP's
