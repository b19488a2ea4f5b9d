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
    assert list(req.sampling.stop) == [","] and req.request_id == "r1" and req.api_version == 2
    assert build_request([1, 2, 3]).prompt_token_ids.ids == [1, 2, 3]
    assert build_request(messages=[{"role": "user", "content": "x"}]).WhichOneof("input") == "chat"
    assert sniff_mime(b"\xff\xd8\xff\xe0") == "image/jpeg" and sniff_mime(b"??") == ""
    with pytest.raises(TypeError, match="an image must be bytes"):
        build_request("x", images=[42])
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        build_request()
