"""The import arrows DESIGN.md forbids, checked by walking every module's imports (lazy ones inside functions and
``TYPE_CHECKING`` blocks included):

* ``engine/`` imports nothing of Duet; ``kv_transfer/`` no engine, worker, shared-worker or cluster code;
* ``node_common/`` (what both worker kinds share) imports only ``engine`` and ``kv_transfer`` of Duet;
* ``prefill_node/`` and ``decode_node/`` import only ``engine``, ``kv_transfer`` and ``node_common`` of Duet: never
  ``cluster`` and never each other;
* ``duet_client/`` imports no torch, Ray or other Duet package;
* inside ``cluster/``, sub-packages import only those below them: ``cli`` -> ``serve`` -> ``control`` ->
  ``experts`` / ``planner`` -> ``report`` / ``demo`` (the package's ``__init__`` and top-level modules count as
  the bottom);
* no runtime module imports a benchmark (``duet_bench``), except ``duet bench``'s own subcommand module
  (:mod:`cluster.cli.bench_cmd`, lazily inside the subcommand), and none imports the testing helpers
  (``duet_testing``: tiny checkpoints, which need transformers);
* ``duet_testing`` (used by tests and benches) imports no runtime package above ``engine``;
* developer scripts (``scripts``, the demo's training) are never imported by an installed package;
* no import cycle between modules, anywhere (lazy imports count: a cycle is a tangle even when it loads).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DUET = ("engine", "kv_transfer", "node_common", "cluster", "prefill_node", "decode_node", "duet_client")
PACKAGES = (*DUET, "duet_bench", "duet_testing", "scripts")
BENCH_ENTRY = "cluster/cli/bench_cmd.py"  # the one runtime module allowed to import duet_bench


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
    "cluster": lambda name: top(name) in ("scripts", "duet_testing"),
    "duet_testing": only("duet_testing", "engine"),
    "duet_bench": lambda name: top(name) == "scripts",
}
# cluster sub-packages, highest first; each may import only itself and those after it in a lower rank
CLUSTER_RANKS = {"cli": 4, "serve": 3, "control": 2, "experts": 1, "planner": 1, "report": 0, "demo": 0, "": 0}


def cluster_sub(name: str) -> str | None:
    """``cluster.serve.x`` -> ``serve``; ``cluster`` or ``cluster.report`` -> ``report`` / ``""``."""
    parts = name.split(".")
    if parts[0] != "cluster":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in CLUSTER_RANKS else ""


@pytest.mark.parametrize("package", list(RULES))
def test_package_imports_only_what_it_may(package):
    bad = {mod: sorted(n for n in names if RULES[package](n)) for mod, names in imports(package).items()}
    assert not {m: n for m, n in bad.items() if n}, bad


def test_cluster_subpackages_import_only_lower_ones():
    bad = {}
    for mod, names in imports("cluster").items():
        here = cluster_sub(mod.removesuffix(".py").replace("/", "."))
        assert here is not None
        up = sorted(n for n in names if (sub := cluster_sub(n)) is not None and sub != here
                    and CLUSTER_RANKS[sub] >= CLUSTER_RANKS[here] and not (mod == BENCH_ENTRY))
        if up:
            bad[mod] = up
    assert not bad, bad


def module_graph() -> dict[str, set[str]]:
    """module -> Duet modules it imports (relative imports resolved; a name imported from a package counts as the
    submodule when there is one). The generated ``_proto`` stubs are nodes too: left out, an import of
    ``duet_client._proto...`` would resolve to the ``duet_client`` package and every client module would seem to
    import its own ``__init__``."""
    files = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            parts = file.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, file in files.items():
        package = mod if file.name == "__init__.py" else mod.rpartition(".")[0]
        names = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                names |= {base, *(f"{base}.{a.name}" for a in node.names)}
        graph[mod] = {r for n in names if (r := resolve(n)) is not None and r != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(module_graph()) == []


def is_bench(name: str) -> bool:
    return name == "duet_bench" or name.startswith("duet_bench.")


def test_runtime_never_imports_a_benchmark():
    runtime = {mod: names for p in DUET for mod, names in imports(p).items() if not mod.startswith("duet_bench/")}
    bad = {mod: sorted(filter(is_bench, names)) for mod, names in runtime.items() if mod != BENCH_ENTRY}
    assert not {m: n for m, n in bad.items() if n}, bad


def test_runtime_never_imports_the_testing_helpers():
    runtime = {mod: names for p in DUET for mod, names in imports(p).items()}
    bad = {mod: sorted(n for n in names if top(n) == "duet_testing") for mod, names in runtime.items()}
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


RUNTIME_MAX_LINES = 400


def test_no_runtime_file_over_400_lines():
    """Benches, testing helpers, tests and generated stubs aside."""
    long = {str(f.relative_to(ROOT)): n for p in DUET for f in (ROOT / p).rglob("*.py")
            if "_proto" not in f.parts and (n := len(f.read_text().splitlines())) > RUNTIME_MAX_LINES}
    assert not long, long
