"""``duet bench ...``: the benchmark subcommands (:mod:`duet_bench`, a package apart from the runtime).

The only runtime module that imports a benchmark, and only inside :func:`add_bench_arguments` when the command line
is a ``duet bench`` one (the import-rule test, ``tests/test_layering.py``, allows exactly this module): the rest of
the CLI, the server and the workers never load benchmark code. The benchmarks' dependencies come with the ``bench``
extra; without them ``duet bench`` says what to install and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

BENCH_EXTRA = "pip install 'duet-serve[bench]'"
# what the bench extra installs beside the runtime (pyproject.toml: [project.optional-dependencies] bench)
BENCH_REQUIRES = ("transformers", "matplotlib")

# bench subcommand -> "module:function" that runs it; imported only when chosen
BENCH_COMMANDS = {
    "engine": "duet_bench.engine_bench:run",
    "quality": "duet_bench.quality_bench:run",
    "transfer": "duet_bench.transfer_bench:run",
    "kv-codec": "duet_bench.kvcodec_bench:run",
    "experts": "duet_bench.experts_bench:run",
    "serve": "duet_bench.serve_bench:run",
    "chaos": "duet_bench.chaos:run",
    "structured": "duet_bench.structured_bench:run",
    "prefix": "duet_bench.prefix_bench:run",
    "memory": "duet_bench.memory_bench:run_bench",
    "startup": "duet_bench.startup_bench:run",
}


def missing_bench_requirements() -> list[str]:
    """The bench extra's packages that are not installed (empty: ``duet bench`` can run)."""
    return [m for m in BENCH_REQUIRES if importlib.util.find_spec(m) is None]


def add_bench_arguments(b: argparse.ArgumentParser, *, load: bool = True) -> None:
    """Register the bench subcommands. ``load=False`` (a command line that is not ``duet bench``) registers the
    word only, so other commands import no benchmark; ``load=True`` without the bench extra exits with the command
    that installs it."""
    if not load:
        b.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    missing = missing_bench_requirements()
    if missing:
        print(f"duet: error: duet bench needs the bench extra ({', '.join(missing)} not installed): {BENCH_EXTRA}",
              file=sys.stderr)
        raise SystemExit(2)
    bsub = b.add_subparsers(dest="bench", required=True)
    from duet_bench.engine_bench import add_arguments

    add_arguments(bsub.add_parser("engine", help="engine vs transformers generate, same checkpoint, same run"))
    from duet_bench.quality_bench import add_arguments as add_quality_arguments

    add_quality_arguments(bsub.add_parser("quality", help="demo-task exact-match accuracy (held-out set)"))
    from duet_bench.transfer_bench import add_arguments as add_transfer_arguments

    add_transfer_arguments(bsub.add_parser("transfer", help="KV hand-off prefill -> decode: TTFT, GB/s, exposed time"))
    from duet_bench.kvcodec_bench import add_arguments as add_kvcodec_arguments

    add_kvcodec_arguments(bsub.add_parser("kv-codec", help="KV compression policies: bytes, speed, agreement, accuracy"))
    from duet_bench.experts_bench import add_arguments as add_experts_arguments

    add_experts_arguments(bsub.add_parser("experts", help="expert placement balancedness, migration and pre-warm"))
    from duet_bench.serve_bench import add_arguments as add_serve_bench_arguments

    add_serve_bench_arguments(bsub.add_parser("serve", help="open-loop serving: colocated engine vs disaggregated"))
    from duet_bench.chaos import add_arguments as add_chaos_arguments

    add_chaos_arguments(bsub.add_parser("chaos", help="chaos soak of duet serve: faults under open-loop load"))
    from duet_bench.structured_bench import add_arguments as add_structured_arguments

    add_structured_arguments(bsub.add_parser("structured", help="structured outputs' per-token cost vs free generation"))
    from duet_bench.prefix_bench import add_arguments as add_prefix_arguments

    add_prefix_arguments(bsub.add_parser("prefix", help="Qwen3.5 prefix hit (GDN state snapshots) vs a cold prefill"))
    from duet_bench.memory_bench import add_arguments as add_memory_arguments

    add_memory_arguments(bsub.add_parser("memory", help="one decode worker's budget: static pool vs coded image KV"))
    from duet_bench.startup_bench import add_arguments as add_startup_arguments

    add_startup_arguments(bsub.add_parser("startup", help="duet serve from launch to ready (and its first answer)"))
