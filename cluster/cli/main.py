"""The ``duet`` command line.

``duet generate [MODEL_DIR] (--prompt TEXT | --token-ids 1,2,3) [--image PATH ...]`` runs one request offline;
``duet bench engine [MODEL_DIR]`` benchmarks the engine against transformers; ``duet bench quality [MODEL_DIR]``
measures the demo task's accuracy; ``duet bench transfer [MODEL_DIR]`` measures the KV hand-off between
prefill and decode workers. ``duet serve`` serves gRPC and OpenAI-compatible HTTP (:mod:`cluster.serve`);
``duet client generate --target HOST:PORT PROMPT`` calls it (:mod:`duet_client.cli`). Errors a user can cause print
one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from cluster.cli.bench_cmd import BENCH_COMMANDS

EXIT_USAGE = 2


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _resident(text: str) -> float | int:
    """``--expert-resident``: ``0.25`` is a fraction, ``2`` a count of experts per layer."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--expert-resident must be a fraction or a count, got {text!r}") from None


def _transports() -> tuple[str, ...]:
    from kv_transfer.registry import TRANSPORTS

    return TRANSPORTS


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole ``duet`` parser. The bench subcommands (and their modules) load only when ``argv`` is a
    ``duet bench`` command line (``None``: load them)."""
    p = argparse.ArgumentParser(prog="duet", description="Duet: disaggregated serving for multimodal MoE models")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run one prompt through the engine (offline)")
    g.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the embedded demo model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text; each <image> marks where an --image goes")
    src.add_argument("--token-ids", type=_token_ids, help="input ids exactly as transformers takes them")
    g.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    g.add_argument("--max-visual-tokens", type=int, default=None, metavar="N",
                   help="visual tokens the images may take together (default: duet serve's limit, 16384; a Qwen-VL "
                        "image's count grows with its size)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.add_argument("--raw-prompt", action="store_true", help="do not apply the checkpoint's chat template")
    g.add_argument("--mode", choices=["local", "disagg"], default="local",
                   help="local: one in-process engine; disagg: prefill and decode actors on Ray")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers (--mode disagg)")
    g.add_argument("--decode", type=int, default=1, help="decode workers (--mode disagg)")
    g.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="decode workers per expert-parallel group sharing the MoE experts (--mode disagg; divides "
                        "--decode)")
    g.add_argument("--expert-resident", type=_resident, default=None, metavar="R",
                   help="experts per MoE layer kept on each decode worker's device: a fraction (0.25) or a count "
                        "(2); the rest stay in host memory (--mode disagg; default: all)")
    g.add_argument("--expert-cache-policy", choices=["lru", "duet"], default="duet",
                   help="with --expert-resident: lru (load on demand) or duet (pre-warm from routing hints)")
    # the transports' names come from kv_transfer (which imports torch): read only for a `duet generate` line, so
    # `duet client` and `duet status` start without torch (1.8 -> 0.17 s)
    g.add_argument("--kv-transport", choices=_transports() if argv is None or argv[:1] == ["generate"] else None,
                   default="gloo",
                   help="how KV moves from prefill to decode (--mode disagg)")
    g.add_argument("--kv-compression", default="none", metavar="POLICY",
                   help="KV compression on the wire (--mode disagg): none, default, aggressive, or a JSON policy")
    from cluster.cli.bench_cmd import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmarks (table + JSON; needs the bench extra)"),
                        load=argv is None or (bool(argv) and argv[0] == "bench"))
    from cluster.cli.plan_cmd import add_arguments as add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="size prefill/decode pools for a workload (simulation)"))
    from cluster.cli.status_cmd import add_arguments as add_status_arguments

    add_status_arguments(sub.add_parser("status", help="cluster table of a running `duet serve`"))
    from cluster.serve.cli import add_arguments as add_serve_arguments
    from duet_client.cli import add_arguments as add_client_arguments

    add_serve_arguments(sub.add_parser("serve", help="serve gRPC (duet.v1) and OpenAI-compatible HTTP"))
    add_client_arguments(sub.add_parser("client", help="call a Duet server over gRPC"))
    return p


# (command, bench subcommand) -> "module:function" that runs it; imported only when chosen
COMMANDS = {
    ("generate", None): "cluster.cli.generate_cmd:run_generate",
    **{("bench", name): target for name, target in BENCH_COMMANDS.items()},
    ("plan", None): "cluster.cli.plan_cmd:run",
    ("status", None): "cluster.cli.status_cmd:run",
    ("serve", None): "cluster.serve.cli:run",
    ("client", None): "duet_client.cli:run",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    target = COMMANDS.get((args.command, getattr(args, "bench", None)))
    if target is None:
        return EXIT_USAGE
    module, func = target.split(":")
    try:
        return getattr(importlib.import_module(module), func)(args)
    except Exception as e:
        errors = sys.modules.get("engine.errors")  # a DuetError comes from a command that imported the engine
        if errors is None or not isinstance(e, errors.DuetError):
            raise
        print(f"duet: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, separators=(", ", ": ")))


if __name__ == "__main__":
    sys.exit(main())
