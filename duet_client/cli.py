"""``duet client`` (also ``duet-client`` when the SDK is installed alone): talk to a Duet server over gRPC.

    duet client generate --target 127.0.0.1:50051 "<image>How many shapes are there?" --image shapes.png
    duet client models --target 127.0.0.1:50051
    duet client status --target 127.0.0.1:50051

``generate`` streams the text to stdout as it arrives (``--json``: one object with the text, finish reason, usage
and timeline instead). Errors print one line and exit with code 2 (bad request, auth) or 1 (server unreachable or
failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from duet_client.channel import TLSConfig
from duet_client.client import Client
from duet_client.errors import DuetClientError, InvalidArgument, Unauthenticated


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="client_command", required=True)
    g = sub.add_parser("generate", help="stream one completion")
    _common(g)
    g.add_argument("prompt", help="prompt text; each <image> marks where an --image goes")
    g.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeat for several)")
    g.add_argument("--raw-prompt", action="store_true", help="do not apply the model's chat template")
    g.add_argument("--model", default="", help="model name (default: the server's)")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    for name, help_ in (("models", "list the served models"), ("status", "workers, queues, KV use, expert load")):
        _common(sub.add_parser(name, help=help_))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="server address HOST:PORT")
    p.add_argument("--token", help="bearer token (default: $DUET_TOKEN)")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --ca-cert)")
    p.add_argument("--ca-cert", help="PEM CA bundle to verify the server with (implies --tls)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")


def run(args: argparse.Namespace) -> int:
    tls = TLSConfig(root_certificates=args.ca_cert) if args.ca_cert else bool(args.tls)
    try:
        with Client(args.target, token=args.token or os.environ.get("DUET_TOKEN"), tls=tls) as client:
            if args.client_command == "models":
                _print_json(client.list_models(timeout=args.timeout))
            elif args.client_command == "status":
                _print_json(client.cluster_status(timeout=args.timeout))
            else:
                _generate(client, args)
    except (InvalidArgument, Unauthenticated) as e:
        print(f"duet client: error: {e.details}", file=sys.stderr)
        return 2
    except DuetClientError as e:
        print(f"duet client: error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"duet client: error: {e}", file=sys.stderr)
        return 2
    return 0


def _generate(client: Client, args: argparse.Namespace) -> None:
    options = {"images": args.image, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
               "raw_prompt": args.raw_prompt, "model": args.model}
    with client.generate(args.prompt, timeout=args.timeout, **options) as stream:
        for delta in stream:
            if not args.json:
                print(delta.text, end="", flush=True)
        c = stream.completion
    if args.json:
        _print_json({"request_id": c.request_id, "text": c.text, "token_ids": c.token_ids,
                     "finish_reason": c.finish_reason, "usage": vars(c.usage), "timeline": c.timeline})
    else:
        print()


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, separators=(", ", ": ")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet-client", description="Duet gRPC client")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
