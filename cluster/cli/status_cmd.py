"""``duet status [--target HOST:PORT]``: a table of a running ``duet serve`` cluster.

One ``ClusterStatus`` call through the SDK (:meth:`duet_client.Client.cluster_status`); a preamble line with the
model, transport, in-flight requests and KV use, one row per worker (role, liveness -- a dead worker with the pool
healer's state, ``NO/respawning`` or ``NO/given-up`` --, queue depths, KV blocks), the healer's respawns and the
workers it gave up on, and the expert balancedness (mean / max expert load per layer; 1.0 is even). ``--json``
prints the raw status instead. Transfer figures (bytes, GB/s per transport) are not part of ``ClusterStatus``; they are on the server's Prometheus
``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cluster.report import format_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="server address HOST:PORT")
    p.add_argument("--token", help="bearer token (default: $DUET_TOKEN)")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots)")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")


def run(args: argparse.Namespace) -> int:
    from duet_client import Client
    from duet_client.errors import DuetClientError

    try:
        with Client(args.target, token=args.token or os.environ.get("DUET_TOKEN"), tls=bool(args.tls)) as client:
            status = client.cluster_status(timeout=args.timeout)
    except DuetClientError as e:
        print(f"duet status: error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    print(json.dumps(status) if args.json else status_table(status))
    return 0


def status_table(s: dict) -> str:
    """The text ``duet status`` prints for a ``ClusterStatus`` dict (as :func:`message_to_dict` makes it)."""
    kv = s.get("kv_usage", 0.0)
    head = (f"model {s.get('model') or '-'}, transport {s.get('transport') or '-'}, in flight {s.get('in_flight', 0)}"
            f"/{s.get('max_concurrent', 0)}, served {s.get('requests_served', 0)}, decode KV use {kv:.0%}"
            + (", DRAINING" if s.get("draining") else ""))
    header = ["worker", "role", "alive", "waiting", "running", "receiving", "queued tokens", "KV blocks used"]
    rows = []
    for w in s.get("workers", []):
        total, free = w.get("total_blocks", 0), w.get("free_blocks", 0)
        rows.append([w.get("worker_id", "?"), w.get("role", "").removeprefix("WORKER_ROLE_").lower(),
                     _alive(w), str(w.get("waiting", 0)), str(w.get("running", 0)),
                     str(w.get("receiving", 0)), str(w.get("outstanding_tokens", 0)),
                     f"{total - free}/{total}" if total else "-"])
    out = head + "\n" + format_table(header, rows)
    ex = s.get("experts") or {}
    bal = ex.get("balancedness") or []
    if bal:
        out += (f"\nexperts: {ex.get('num_experts')} x {ex.get('num_layers')} layers, {ex.get('tokens_routed')} "
                f"routed, balancedness min {min(bal):.2f} mean {sum(bal) / len(bal):.2f}, placement "
                f"{ex.get('placement') or '-'}")
    h = s.get("healing") or {}
    respawns = h.get("prefill_respawns", 0) + h.get("decode_respawns", 0)
    if respawns or h.get("given_up") or h.get("respawning"):
        out += (f"\nhealing: respawned {h.get('prefill_respawns', 0)} prefill / {h.get('decode_respawns', 0)} decode"
                f"; respawning {', '.join(h.get('respawning', [])) or '-'}"
                f"; GIVEN UP (no longer respawned) {', '.join(h.get('given_up', [])) or '-'}")
    return out


def _alive(w: dict) -> str:
    """``yes``, or ``NO`` with the pool healer's state (``NO/respawning``, ``NO/given-up``)."""
    if w.get("alive"):
        return "yes"
    healing = w.get("healing", "WORKER_HEALING_UNSPECIFIED").removeprefix("WORKER_HEALING_")
    return "NO" if healing == "UNSPECIFIED" else f"NO/{healing.lower().replace('_', '-')}"
