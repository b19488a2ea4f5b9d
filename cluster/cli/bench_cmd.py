"""``duet bench ...``: the benchmark subcommands (:mod:`cluster.bench`).

The only runtime module that imports a benchmark, and only inside :func:`add_bench_arguments` (the import-rule test,
``tests/test_layering.py``, allows exactly this module): the rest of the CLI, the server and the workers never load
benchmark code.
"""

from __future__ import annotations

import argparse

# bench subcommand -> "module:function" that runs it; imported only when chosen
BENCH_COMMANDS = {
    "engine": "cluster.bench.engine_bench:run",
    "quality": "cluster.bench.quality_bench:run",
    "transfer": "cluster.bench.transfer_bench:run",
    "kv-codec": "cluster.bench.kvcodec_bench:run",
    "experts": "cluster.bench.experts_bench:run",
    "serve": "cluster.bench.serve_bench:run",
    "chaos": "cluster.bench.chaos:run",
    "structured": "cluster.bench.structured_bench:run",
}


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    bsub = b.add_subparsers(dest="bench", required=True)
    from cluster.bench.engine_bench import add_arguments

    add_arguments(bsub.add_parser("engine", help="engine vs transformers generate, same checkpoint, same run"))
    from cluster.bench.quality_bench import add_arguments as add_quality_arguments

    add_quality_arguments(bsub.add_parser("quality", help="demo-task exact-match accuracy (held-out set)"))
    from cluster.bench.transfer_bench import add_arguments as add_transfer_arguments

    add_transfer_arguments(bsub.add_parser("transfer", help="KV hand-off prefill -> decode: TTFT, GB/s, exposed time"))
    from cluster.bench.kvcodec_bench import add_arguments as add_kvcodec_arguments

    add_kvcodec_arguments(bsub.add_parser("kv-codec", help="KV compression policies: bytes, speed, agreement, accuracy"))
    from cluster.bench.experts_bench import add_arguments as add_experts_arguments

    add_experts_arguments(bsub.add_parser("experts", help="expert placement balancedness, migration and pre-warm"))
    from cluster.bench.serve_bench import add_arguments as add_serve_bench_arguments

    add_serve_bench_arguments(bsub.add_parser("serve", help="open-loop serving: colocated engine vs disaggregated"))
    from cluster.bench.chaos import add_arguments as add_chaos_arguments

    add_chaos_arguments(bsub.add_parser("chaos", help="chaos soak of duet serve: faults under open-loop load"))
    from cluster.bench.structured_bench import add_arguments as add_structured_arguments

    add_structured_arguments(bsub.add_parser("structured", help="structured outputs' per-token cost vs free generation"))
