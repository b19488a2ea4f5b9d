"""Plain-text tables and JSON files for ``duet bench`` results.

Tables are fixed-width, right-aligned except the first column; a missing value prints as ``-``. JSON is written
atomically (temporary file + rename) so a crash never leaves a half-written result.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


def fmt(value: object, digits: int = 1) -> str:
    """``None``/NaN -> ``-``; floats with ``digits`` decimals; anything else ``str``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, separated by two spaces; first column left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def scenario_table(scenarios: dict[str, dict]) -> str:
    """The main table: one row per scenario result (as :func:`duet_bench.engine_bench.run` stores them).
    "same tokens" counts requests whose greedy tokens equal transformers' (padded batches may legitimately differ)."""
    header = ["scenario", "duet tok/s", "hf tok/s", "ratio", "duet s", "hf s", "ttft ms", "tpot ms", "same tokens"]
    rows = []
    for s in scenarios.values():
        d, h = s["duet"], s["hf"]
        rows.append([s["label"], fmt(d["tokens_per_s"]), fmt(h["tokens_per_s"]), fmt(s["ratio"], 2),
                     fmt(d["wall_s"], 2), fmt(h["wall_s"], 2), fmt(ms(d["mean_ttft_s"])), fmt(ms(d["mean_tpot_s"])),
                     f"{s['requests_matching_hf']}/{s['spec']['num_requests']}"])
    return format_table(header, rows)


def machine_table(machine: dict, bound: dict[str, dict]) -> str:
    """The machine figures as a preamble line, then one row per decode bound. ``of bound``: the best round's TPOT
    against the bandwidth read at the start; ``paired``: the median over rounds of each round's TPOT against the
    bandwidth read just before it (on a shared host the bandwidth moves between the two)."""
    head = (f"machine: read {fmt(machine['read_gbps'])} GB/s, matmul {fmt(machine['matmul_square_gflops'])} GFLOP/s "
            f"({machine['square_n']}^3), {fmt(machine['matmul_skinny_gflops'])} GFLOP/s "
            f"({'x'.join(map(str, machine['skinny_shape']))}), {machine['threads']} threads")
    if machine.get("cpu"):
        cpu = machine["cpu"]
        head += f"; CPU {cpu['model']}, {cpu['logical_cpus']} logical, {' '.join(cpu['flags']) or 'no AVX flags'}"
    header = ["decode", "MB/step", "MFLOP/step", "bound ms", "limited by", "bound tok/s", "duet tpot ms", "of bound",
              "paired"]
    rows = []
    for b in bound.values():
        frac, paired = b["fraction_of_bound"], b.get("paired_fraction_median")
        rows.append([b["label"], fmt(b["bytes_per_step"] / 1e6), fmt(b["flops_per_step"] / 1e6),
                     fmt(b["bound_step_s"] * 1e3, 2), b["limited_by"], fmt(b["bound_tokens_per_s"]),
                     fmt(ms(b["measured_step_s"]), 2), "-" if frac is None else f"{frac:.0%}",
                     "-" if paired is None else f"{paired:.0%}"])
    return head + "\n" + format_table(header, rows)


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds (None stays None)."""
    return None if seconds is None else seconds * 1e3


def log(msg: str) -> None:
    """A benchmark's progress line, on stderr (the table and JSON are the results)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def write_json(path: str | os.PathLike, obj: object) -> Path:
    """Write ``obj`` as indented JSON to ``path`` (parents created), atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
