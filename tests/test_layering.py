"""The import arrows DESIGN.md forbids, checked by walking every module's imports (lazy ones inside functions and
``TYPE_CHECKING`` blocks included):

* ``engine/`` imports nothing of Duet; ``kv_transfer/`` no engine, worker, shared-worker or cluster code;
* ``node_common/`` (what both worker kinds share) imports only ``engine`` and ``kv_transfer`` of Duet;
* ``prefill_node/`` and ``decode_node/`` import only ``engine``, ``kv_transfer`` and ``node_common`` of Duet: never
  ``cluster`` and never each other;
* ``duet_client/`` imports no torch, Ray or other Duet package;
* no runtime module imports a benchmark (``cluster.bench``), except ``duet bench``'s own subcommand module
  (:mod:`cluster.cli.bench_cmd`, lazily inside the subcommand);
* developer scripts (``scripts``, the demo's training) are never imported by an installed package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DUET = ("engine", "kv_transfer", "node_common", "cluster", "prefill_node", "decode_node", "duet_client")
PACKAGES = (*DUET, "scripts")
BENCH_ENTRY = "cluster/cli/bench_cmd.py"  # the one runtime module allowed to import cluster.bench


def imports(package: str) -> dict[str, set[str]]:
    """module path -> dotted names it imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
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
                names |= {f"{node.module}.{a.name}" for a in node.names}
        out[str(file.relative_to(ROOT))] = names
    return out


def top(name: str) -> str:
    return name.split(".")[0]


def only(*allowed: str):
    """A rule: any Duet package (or ``scripts``) outside ``allowed`` is forbidden."""
    return lambda name: top(name) in PACKAGES and top(name) not in allowed


RULES = {
    "engine": only("engine"),
    "kv_transfer": only("kv_transfer"),
    "node_common": only("node_common", "engine", "kv_transfer"),
    "prefill_node": only("prefill_node", "node_common", "engine", "kv_transfer"),
    "decode_node": only("decode_node", "node_common", "engine", "kv_transfer"),
    "duet_client": lambda name: top(name) in ("torch", "ray", *[p for p in PACKAGES if p != "duet_client"]),
    "cluster": lambda name: top(name) == "scripts",
}


@pytest.mark.parametrize("package", list(RULES))
def test_package_imports_only_what_it_may(package):
    bad = {mod: sorted(n for n in names if RULES[package](n)) for mod, names in imports(package).items()}
    assert not {m: n for m, n in bad.items() if n}, bad


def is_bench(name: str) -> bool:
    return name == "cluster.bench" or name.startswith("cluster.bench.")


def test_runtime_never_imports_a_benchmark():
    runtime = {mod: names for p in DUET for mod, names in imports(p).items() if not mod.startswith("cluster/bench/")}
    bad = {mod: sorted(filter(is_bench, names)) for mod, names in runtime.items() if mod != BENCH_ENTRY}
    assert not {m: n for m, n in bad.items() if n}, bad


def test_the_bench_entry_imports_benchmarks_lazily_only():
    """``cluster.cli.bench_cmd`` loads a benchmark only when ``duet bench`` is parsed, never at import time."""
    tree = ast.parse((ROOT / BENCH_ENTRY).read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top_level for a in n.names} | {n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)}
    assert not [n for n in names if is_bench(n)]


def test_rules_cover_every_package():
    """Every top-level Python package of the repository is either ruled here or known not to be runtime."""
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert found <= set(RULES) | {"tests", "scripts", "protos"}, found - set(RULES)
