"""``duet bench startup``: how long ``duet serve`` takes from launch to its ready line, and to its first answer.

A new user's first impression and an autoscaler's reaction time are both a cold start: the Ray cluster, the workers'
processes, the model's load and the kernel choices measured at load. Each system is started fresh ``--rounds`` times
(a new process and Ray cluster each time, stopped with SIGINT after), the order rotating each round so that drift on
a shared host falls on every system alike; the table gives each one's median and its ratio to the first system's.

Systems: this checkout's default model (the baseline), each ``--model-dir`` on this checkout, and each
``--checkout DIR`` (another source tree, e.g. a ``git worktree`` of an older commit, with its own default model) run
by this interpreter with that tree first on ``PYTHONPATH``.

``--cache`` says what the workers' kernel-choice cache (``engine.tuning_cache``) holds at each start: ``first`` (the
default) an empty directory of its own, as on a new host (the first worker measures, the second reads its answers);
``off`` none (every worker measures); ``warm`` what an untimed start of the same system wrote (a restart).
``--first-request`` also times one chat completion sent the moment the server is ready (``--image``: with that
image), which shows one-time costs that moved from start-up to the first request.

Beside the wall time, each start's phases as the server reports them (``duet serve: started in ...`` on stderr): Ray
(its start, with the server's imports), workers (their processes and model loads), front-end. Ray's own start waits
for its raylet in whole seconds (``ray._private.services``: 1 s sleeps), so on a busy 2-core host a start's Ray
phase is about 2.3 or 3.3 s by chance and the wall time is bimodal; the workers' phase is what a model changes.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import mimetypes
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster.report import fmt, format_table, write_json
from duet_bench.machine import cpu_description

CACHE_MODES = ("first", "off", "warm")
READY = "duet serve: ready"
PHASES = ("Ray", "workers", "front-end")  # the server's phases, in the order it reports them
STARTED = re.compile(r"duet serve: started in ([\d.]+) s \((.*)\)")  # the server's own account of its phases
ROOT = Path(__file__).resolve().parents[1]
SERVE = "import sys; from cluster.cli.main import main; sys.exit(main())"


class StartupError(RuntimeError):
    """A server that exited, or said nothing, before its ready line."""


@dataclass
class System:
    label: str
    root: Path  # the source tree it runs from
    model_dir: Path | None  # None: that tree's default model
    ready_s: list[float] = field(default_factory=list)
    first_request_s: list[float | None] = field(default_factory=list)  # None: not sent
    phases: list[dict[str, float]] = field(default_factory=list)  # per start, as the server reported them


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="also start this checkpoint on this checkout (repeatable)")
    p.add_argument("--checkout", action="append", default=[], metavar="DIR",
                   help="also start another source tree's default model (repeatable)")
    p.add_argument("--rounds", type=int, default=5, help="starts of each system, alternating")
    p.add_argument("--cache", choices=CACHE_MODES, default="first",
                   help="the kernel-choice cache at each start: first (empty), off, warm (a restart)")
    p.add_argument("--first-request", action="store_true", help="also time one chat completion after ready")
    p.add_argument("--image", type=Path, help="the first request's image (default: text only)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="the longest one start or request may take")
    p.add_argument("--pause-s", type=float, default=2.0, help="pause after each stop (Ray's processes exit)")
    p.add_argument("--json", default="bench_out/startup.json", help="where to write the results")


def systems_for(args: argparse.Namespace) -> list[System]:
    out = [System("default", ROOT, None)]
    out += [System(f"model:{Path(d).name}", ROOT, Path(d).resolve()) for d in args.model_dir]
    out += [System(f"checkout:{Path(c).name}", Path(c).resolve(), None) for c in args.checkout]
    return out


def serve_command(system: System) -> list[str]:
    cmd = [sys.executable, "-c", SERVE, "serve", "--grpc-port", "0", "--http-port", "0"]
    return cmd + (["--model-dir", str(system.model_dir)] if system.model_dir is not None else [])


def order(systems: list, round_index: int) -> list:
    """Round ``r`` starts at system ``r mod n``: each goes first, second, ... equally often over ``n`` rounds."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def wait_ready(proc: subprocess.Popen, deadline: float) -> str:
    """The ready line ``proc`` prints on stdout; StartupError if it exits or ``deadline`` (monotonic) passes
    first."""
    buf = b""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartupError(f"no ready line within the deadline (stdout so far: {buf[-500:]!r})")
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            proc.wait(timeout=10)
            raise StartupError(f"the server exited with code {proc.returncode} before its ready line")
        buf += chunk
        for line in buf.split(b"\n")[:-1]:  # whole lines only: the ready line may come in two reads
            if line.startswith(READY.encode()):
                return line.decode(errors="replace")


def ready_fields(line: str) -> dict[str, str]:
    """``key=value`` words of the ready line (``http``, ``model``, ...)."""
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def parse_phases(stderr: str) -> dict[str, float]:
    """``{"Ray": s, "workers": s, "front-end": s}`` from the server's ``started in`` line (empty without one: a
    server older than that line)."""
    m = STARTED.search(stderr)
    if m is None:
        return {}
    return {name: float(v) for name, v in (re.fullmatch(r"(.+) ([\d.]+) s", part.strip()).groups()
                                           for part in m.group(2).split(","))}


def first_request(url: str, model: str, image: Path | None, timeout_s: float) -> None:
    """One non-streamed chat completion of at most 8 tokens; raises on anything but a 200 with a choice."""
    content: list[dict] = [{"type": "text", "text": "Describe the image." if image else "Hello"}]
    if image is not None:
        data = base64.b64encode(image.read_bytes()).decode()
        kind = mimetypes.guess_type(image.name)[0] or "image/png"
        content.insert(0, {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{data}"}})
    body = json.dumps({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 -- the URL the server printed
            reply = json.loads(resp.read())
    except (OSError, ValueError) as e:  # urllib's HTTP and connection errors, a timeout, a body that is not JSON
        raise StartupError(f"the first request failed: {e}") from None
    if not reply.get("choices"):
        raise StartupError(f"the first request got no choice: {str(reply)[:300]}")


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGINT (the server drains and stops its Ray cluster), a second one (abort in-flight requests) after half of
    ``timeout_s``; past it, SIGKILL to the server's whole session (its Ray processes with it)."""
    for _ in range(2):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s / 2)
            return
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def start_once(system: System, cmd: list[str], cache: str, args: argparse.Namespace, *, request: bool
               ) -> tuple[float, float | None, dict[str, float]]:
    """Start ``cmd`` with the tuning cache ``cache`` (a directory, or "off"), time it to its ready line (and, with
    ``request``, through a first request), stop it. (ready s, first request s or None, the server's phases)."""
    path = [str(system.root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, DUET_TUNING_CACHE=cache, PYTHONPATH=os.pathsep.join(path))
    err = tempfile.TemporaryFile()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=system.root, env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        line = wait_ready(proc, t0 + args.timeout_s)
        ready = time.monotonic() - t0
        first = None
        if request:
            f = ready_fields(line)
            if "http" not in f:
                raise StartupError(f"the ready line names no HTTP endpoint for the first request: {line!r}")
            t1 = time.monotonic()
            first_request(f["http"], f.get("model", ""), args.image, args.timeout_s)
            first = time.monotonic() - t1
    finally:
        stop(proc, min(60.0, args.timeout_s))
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        err.close()
        time.sleep(args.pause_s)
    return ready, first, parse_phases(stderr)


def summarize(systems: list[System]) -> list[dict]:
    base = statistics.median(systems[0].ready_s)
    rows = []
    for s in systems:
        med = statistics.median(s.ready_s)
        first = [x for x in s.first_request_s if x is not None]
        names = [k for k in PHASES if any(k in p for p in s.phases)]
        rows.append({"system": s.label, "starts": len(s.ready_s), "ready_p50_s": med, "ready_min_s": min(s.ready_s),
                     "ready_max_s": max(s.ready_s), "ratio_to_baseline": med / base,
                     "first_request_p50_s": statistics.median(first) if first else None,
                     **{f"{k}_p50_s": statistics.median(p[k] for p in s.phases if k in p) for k in names}})
    return rows


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        print("duet: error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.image is not None and not args.image.is_file():
        print(f"duet: error: --image {args.image}: no such file", file=sys.stderr)
        return 2
    systems = systems_for(args)
    for s in systems:
        if not s.root.is_dir() or (s.model_dir is not None and not (s.model_dir / "config.json").is_file()):
            print(f"duet: error: {s.label}: {s.model_dir or s.root} is not a checkpoint / source tree",
                  file=sys.stderr)
            return 2
    caches = tempfile.mkdtemp(prefix="duet-startup-")
    started = dt.datetime.now(dt.timezone.utc).isoformat()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    try:
        warm = {}
        if args.cache == "warm":  # one untimed start each writes the answers its restarts read
            for s in systems:
                warm[s.label] = tempfile.mkdtemp(dir=caches)
                start_once(s, serve_command(s), warm[s.label], args, request=False)
        for r in range(args.rounds):
            for s in order(systems, r):
                cache = "off" if args.cache == "off" else warm[s.label] if args.cache == "warm" \
                    else tempfile.mkdtemp(dir=caches)
                ready, first, phases = start_once(s, serve_command(s), cache, args, request=args.first_request)
                s.ready_s.append(ready)
                s.first_request_s.append(first)
                s.phases.append(phases)
                print(f"round {r}: {s.label} ready in {fmt(ready, 2)} s", file=sys.stderr, flush=True)
    except StartupError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    rows = summarize(systems)
    print(format_table(["system", "starts", "ready p50 s", "min", "max", "ratio", *(f"{k} p50 s" for k in PHASES),
                        "first request p50 s"],
                       [[x["system"], str(x["starts"]), fmt(x["ready_p50_s"], 2), fmt(x["ready_min_s"], 2),
                         fmt(x["ready_max_s"], 2), fmt(x["ratio_to_baseline"], 2),
                         *(fmt(x.get(f"{k}_p50_s"), 2) for k in PHASES), fmt(x["first_request_p50_s"], 3)]
                        for x in rows]))
    print(f"cache {args.cache}, {args.rounds} rounds alternating; load average at the start {load}")
    write_json(Path(args.json), {
        "cache": args.cache, "rounds": args.rounds, "first_request": args.first_request,
        "image": None if args.image is None else str(args.image), "cpu": cpu_description(), "load_average": load,
        "started_at": started, "summary": rows,
        "systems": [{"label": s.label, "root": str(s.root),
                     "model_dir": None if s.model_dir is None else str(s.model_dir), "ready_s": s.ready_s,
                     "first_request_s": s.first_request_s, "phases": s.phases}
                    for s in systems]})
    return 0
