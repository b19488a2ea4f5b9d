"""The import arrows DESIGN.md forbids, checked by walking every module's imports (the parts that hold today:
``engine/`` imports nothing of Duet, ``kv_transfer/`` no engine or worker code, ``duet_client/`` no torch, Ray or
Duet package). The worker packages' and benchmarks' arrows are issue 17's to straighten, then to add here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DUET = ("engine", "kv_transfer", "cluster", "prefill_node", "decode_node", "duet_client")


def imports(package: str) -> dict[str, set[str]]:
    """module path -> top-level names (with the first sub-package for Duet packages) it imports."""
    out: dict[str, set[str]] = {}
    for file in sorted((ROOT / package).rglob("*.py")):
        if "_proto" in file.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[str(file.relative_to(ROOT))] = names
    return out


RULES = {
    "engine": lambda name: name.split(".")[0] in DUET and name.split(".")[0] != "engine",
    "kv_transfer": lambda name: name.split(".")[0] in ("engine", "cluster", "prefill_node", "decode_node"),
    "duet_client": lambda name: name.split(".")[0] in ("torch", "ray", *[p for p in DUET if p != "duet_client"]),
}


@pytest.mark.parametrize("package", list(RULES))
def test_package_imports_only_what_it_may(package):
    bad = {mod: sorted(n for n in names if RULES[package](n)) for mod, names in imports(package).items()}
    assert not {m: n for m, n in bad.items() if n}, bad

