"""``duet bench chaos``: a bounded chaos soak of ``duet serve`` on loopback (:mod:`duet_bench.chaos.soak`).

Open-loop streaming image requests through the gRPC API while it injects, at random and one at a time, the faults of
:mod:`duet_bench.chaos.faults` (worker SIGKILLs, a stalled or corrupting link via
:mod:`duet_bench.chaos.proxy`, lease expiry, abort storms, a restart of ``duet serve``, the loss of the Ray head:
its GCS and raylet SIGKILLed, then a head again at the same address); prints the outcome and fault tables
(:mod:`duet_bench.chaos.report`) and writes the JSON. Exit code 1 when the bar is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt

from duet_bench.chaos.faults import FAULTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--rate", type=float, default=32.0, help="requests per second, open loop (default 32)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of fault kinds (default all: "
                                                              f"{','.join(FAULTS)})")
    p.add_argument("--num-faults", type=int, default=None, help="stop injecting after N faults (default: no cap)")
    p.add_argument("--gap", default="8,16", help="random pause between faults, 'MIN,MAX' seconds (default 8,16)")
    p.add_argument("--storm", type=int, default=24, help="requests per abort storm")
    p.add_argument("--expert-parallel", type=int, default=2, help="decode expert-parallel group size (MoE models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_out/chaos.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="30 s at 4 req/s with three faults (tests)")


def run(args: argparse.Namespace) -> int:
    from duet_bench.chaos.report import summary, tables
    from duet_bench.chaos.soak import SoakConfig, run_soak
    from cluster.demo import default_model_dir
    from cluster.report import write_json

    lo, hi = (float(x) for x in args.gap.split(","))
    faults = tuple(f for f in args.faults.split(",") if f)
    c = SoakConfig(model_dir=str(args.model_dir or default_model_dir()), rate=args.rate, duration_s=args.duration,
                   faults=faults, num_faults=args.num_faults, gap_s=(lo, hi), storm=args.storm,
                   expert_parallel=args.expert_parallel, seed=args.seed)
    if args.quick:
        c = dataclasses.replace(c, rate=4.0, duration_s=min(args.duration, 30.0), num_faults=args.num_faults or 3,
                                gap_s=(2.0, 4.0), storm=8, pool=12)
    raw = run_soak(c)
    s = summary(raw, rate=c.rate, duration_s=c.duration_s)
    path = write_json(args.json, {"config": dataclasses.asdict(c), **s, "records": raw["records"],
                                  "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    print(tables(s))
    print(f"wrote {path} (the machine is shared: rates and recovery times are this host's, under its load)")
    return 0 if s["ok"] else 1
