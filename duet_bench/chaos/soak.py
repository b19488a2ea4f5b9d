"""The soak: a ``duet serve`` process under open-loop load while faults are injected at random, then the verdict.

Setup (loopback only): this process hosts the Ray head, or, when ``kill_head`` is among the faults, the head runs in
processes of its own (``ray start --head``, :mod:`duet_bench.chaos.head`) that this process never connects to, so
the GCS can die under it; ``duet serve --address`` runs as a child process (so it can be SIGKILLed and restarted)
with 2 prefill and 2 decode workers (an expert-parallel group of 2 when the model has experts), the gRPC KV
transport dialling through a :class:`~duet_bench.chaos.proxy.FaultProxy`, short leases.
Load: Poisson arrivals of streaming image requests (the prompts of :func:`duet_bench.serve_workload.make_workload`,
a pool replayed round-robin) through the SDK's ``AsyncClient``; a client retries a typed failure (reconnecting after
a restart) up to ``attempts`` times within its deadline. Faults: :mod:`duet_bench.chaos.faults`, a shuffled cycle
over the kinds asked for, one at a time at random gaps; after each, recovery = until a probe request is answered
correctly and every worker is alive again.

Each request ends as exactly one of: ``correct`` (greedy tokens equal the reference the local engine computed
without faults), ``typed`` (a typed error after its retries), ``hung`` (an attempt the server did not end within its
``request_timeout_s`` + 15 s), ``wrong`` (tokens differ), ``untyped`` (INTERNAL / UNKNOWN or a non-client exception).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from duet_bench.chaos.faults import FAULTS, Target, inject, worker_pids
from duet_bench.chaos.head import ExternalHead, LocalHead, alive
from duet_bench.chaos.proxy import FaultProxy

OUTCOMES = ("correct", "typed", "hung", "wrong", "untyped")
RECOVERY_BOUND_S = 30.0
WORKERS = 4  # the soak's cluster: 2 prefill + 2 decode workers (spec_fields)


@dataclass(frozen=True)
class SoakConfig:
    model_dir: str
    rate: float = 32.0  # requests per second, open loop
    duration_s: float = 300.0
    faults: tuple[str, ...] = FAULTS
    num_faults: int | None = None  # None: as many as fit (gap_s apart)
    gap_s: tuple[float, float] = (8.0, 16.0)  # random pause between one fault's recovery and the next
    hold_s: float = 3.5  # a stall / corruption / freeze (longer than lease_base_s)
    storm: int = 24
    pool: int = 48  # distinct prompts
    output_max: int = 12
    attempts: int = 3
    request_timeout_s: float = 20.0  # the server's; the client waits this + 15 s before calling a request hung
    expert_parallel: int = 2
    seed: int = 0
    log_dir: str = "bench_out/chaos"


def spec_fields(c: SoakConfig, proxy: str) -> dict:
    """The ``duet serve --config`` of the soak (ClusterSpec fields + ``serve:``)."""
    from engine.config import ModelConfig

    moe = ModelConfig.from_pretrained(c.model_dir).text.num_experts > 0
    return {"model_dir": c.model_dir, "num_prefill": 2, "num_decode": 2, "transport": "grpc", "kv_proxy": proxy,
            "expert_parallel": c.expert_parallel if moe else 1, "expert_rebalance_s": 0, "expert_group_timeout_s": 15,
            "lease_base_s": 2.0, "request_timeout_s": c.request_timeout_s, "num_kv_blocks": 512, "block_size": 16,
            "max_num_seqs": 32, "cpus_per_worker": 1, "health_ping_s": 0.5, "health_ping_timeout_s": 8,
            "respawn_max_deaths": 20, "respawn_window_s": 60,
            "serve": {"http_port": 0, "drain_timeout_s": 1, "limits": {"max_concurrent": 1024}}}


class ServeProcess:
    """``duet serve`` as a child process on a fixed gRPC port (so a restart keeps the clients' target)."""

    def __init__(self, config: Path, ray_address: str, log: Path, env: dict[str, str]) -> None:
        self.port = _free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--address", ray_address,
                     "--grpc-port", str(self.port)]
        self._log = log
        self._env = os.environ | env  # the head's (its auth mode)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    async def start(self, timeout_s: float = 180.0) -> float:
        t0 = time.monotonic()
        with open(self._log, "a") as err:
            self.proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=self._env)
        self.starts += 1
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if "ready" not in line:
            raise RuntimeError(f"duet serve did not start: {line!r} (see {self._log})")
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.kill()


class Soak:
    def __init__(self, c: SoakConfig, head: LocalHead | ExternalHead, serve: ServeProcess, pool: list[dict],
                 want: list[list[int]]) -> None:
        from duet_client import AsyncClient

        self.c, self.head, self.serve, self.pool, self.want = c, head, serve, pool, want
        self.client = AsyncClient(serve.target)
        self.rng = random.Random(c.seed)
        self.records: list[dict] = []
        self.storm_outcomes: dict[str, int] = {}
        self.faults: list[dict] = []
        self.orphans: list[int] = []
        self._checks: list[asyncio.Task] = []  # leak checks that run beside the recovery probes

    # -- one request ---------------------------------------------------------------------------------------------
    async def request(self, k: int) -> dict:
        from duet_client.errors import DuetClientError, ResourceExhausted

        item, want = self.pool[k % len(self.pool)], self.want[k % len(self.pool)]
        rec = {"k": k, "start": time.monotonic(), "attempts": 0, "errors": []}
        # the server ends every attempt within its request_timeout_s: one the client has to end itself is hung
        attempt_s = self.c.request_timeout_s + 15
        retry_until = rec["start"] + attempt_s  # new attempts start until then
        while True:
            rec["attempts"] += 1
            began = time.monotonic()
            try:
                got = await asyncio.wait_for(self._stream(item, attempt_s), attempt_s + 5)
            except (asyncio.TimeoutError, TimeoutError):
                rec["outcome"] = "hung"
                break
            except DuetClientError as e:
                name = type(e).__name__
                rec["errors"].append(f"{name}: {str(e)[:160]}")
                if e.code.name in ("INTERNAL", "UNKNOWN"):
                    rec["outcome"] = "untyped"
                    break
                if name == "DeadlineExceeded" and time.monotonic() - began >= attempt_s - 0.5:
                    rec["outcome"] = "hung"  # the client's deadline, not the server's, ended it
                    break
                pause = min(2.0, 0.2 * rec["attempts"]) + self.rng.random() * 0.3
                # a server that is not there (a restart) or full (a pool re-forming) is waited for until the
                # deadline, as its retry hint says; other typed errors are retried ``attempts`` times
                again = name in ("Unavailable", "ResourceExhausted") or rec["attempts"] < self.c.attempts
                if isinstance(e, ResourceExhausted) and e.retry_after_s:
                    pause = max(pause, e.retry_after_s)
                if not again or name in ("InvalidArgument", "Unauthenticated") or time.monotonic() + pause >= retry_until:
                    rec["outcome"] = "typed"
                    break
                await asyncio.sleep(pause)
                continue
            except Exception as e:  # noqa: BLE001 - anything else is a defect, recorded
                rec["errors"].append(f"{type(e).__name__}: {str(e)[:160]}")
                rec["outcome"] = "untyped"
                break
            rec["outcome"] = "correct" if got == want else "wrong"
            if got != want:
                rec["errors"].append(f"got {got} want {want}")
            break
        rec["end"] = time.monotonic()
        return rec

    async def _stream(self, item: dict, timeout: float) -> list[int]:
        tokens: list[int] = []
        stream = self.client.generate(item["prompt"], images=item["images"], max_tokens=item["max_tokens"],
                                      temperature=0.0, ignore_eos=True, raw_prompt=True, timeout=timeout)
        async with stream:
            async for d in stream:
                tokens.extend(d.token_ids)
        return tokens

    async def storm_request(self, cancel_after_s: float) -> None:
        item = self.pool[self.rng.randrange(len(self.pool))]
        try:
            await asyncio.wait_for(self._stream(item, 30), cancel_after_s)
            outcome = "finished"
        except (asyncio.TimeoutError, TimeoutError):
            outcome = "cancelled"
        except Exception as e:  # noqa: BLE001
            outcome = type(e).__name__
        self.storm_outcomes[outcome] = self.storm_outcomes.get(outcome, 0) + 1

    # -- load, faults, recovery ----------------------------------------------------------------------------------
    async def load(self, t0: float) -> None:
        rng = random.Random(self.c.seed + 1)
        tasks, k, at = [], 0, 0.0
        while True:
            at += rng.expovariate(self.c.rate)
            if at >= self.c.duration_s:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(self.request(k)))
            k += 1
        self.records = list(await asyncio.gather(*tasks))

    def workers(self, role: str) -> list[int]:
        return worker_pids(role, self.head.worker_roots())

    async def restart(self) -> list[int]:
        old = self.workers("prefill") + self.workers("decode")
        self.faults[-1]["killed_at"] = time.monotonic()  # recovery counts from here: nothing serves until ready
        self.serve.kill()
        took = await self.serve.start()
        self.faults[-1]["restart_s"] = took
        # the new serve reattaches to the old workers it can reuse (cluster.control.reattach) and kills the rest:
        # within the bound no more worker processes than the cluster has may be left (checked beside the recovery)
        self._checks.append(asyncio.create_task(self._no_extra_workers(old)))
        return old

    async def _no_extra_workers(self, old: list[int]) -> None:
        def live() -> list[int]:
            return self.workers("prefill") + self.workers("decode")

        if await _wait(lambda: len(live()) <= WORKERS, RECOVERY_BOUND_S) is None:
            extra = len(live()) - WORKERS
            self.orphans += [p for p in old if alive(p)][:max(0, extra)] or live()[:max(0, extra)]

    async def lose_head(self) -> dict:
        assert isinstance(self.head, ExternalHead), "kill_head needs the soak's own head process"
        lost = await self.head.lose(self.c.hold_s)
        self.orphans += lost["orphans"]
        return {"detail": f"head down {lost['down_s']:.1f} s, up again in {lost['start_s']:.1f} s"}

    async def chaos(self, t0: float) -> None:
        kinds: list[str] = []
        target = Target(self.proxy, self.workers, self.restart, self.lose_head, self.storm_request, self.c.hold_s,
                        self.c.storm, self.rng)
        end = t0 + self.c.duration_s - 5
        while self.c.num_faults is None or len(self.faults) < self.c.num_faults:
            await asyncio.sleep(self.rng.uniform(*self.c.gap_s))
            if time.monotonic() >= end:
                break
            if not kinds:
                kinds = list(self.c.faults)
                self.rng.shuffle(kinds)
            kind = kinds.pop()
            rec = {"kind": kind, "at_s": time.monotonic() - t0}
            self.faults.append(rec)
            rec |= await inject(kind, target)
            rec["recovery_s"] = await self.recovered(rec.pop("killed_at", rec["over_at"]))
            rec.pop("over_at")
            rec.pop("old_workers", None)

    async def recovered(self, since: float, bound_s: float = 90.0) -> float | None:
        """Seconds from ``since`` until a probe request is answered correctly and every worker is alive."""
        while time.monotonic() - since < bound_s:
            try:
                got = await self._stream(self.pool[0], 10)
                if got == self.want[0] and await self._full():
                    return time.monotonic() - since
            except Exception:  # noqa: BLE001 - not yet recovered
                pass
            await asyncio.sleep(0.25)
        return None

    async def _full(self) -> bool:
        s = await self.client.cluster_status(timeout=5)
        rows = s.get("workers", [])
        return len(rows) == 4 and all(r.get("alive") for r in rows)

    async def end_state(self, settle_s: float = 30.0) -> dict:
        """ClusterStatus once idle (polled up to ``settle_s``): blocks held and per-worker queues."""
        state: dict = {}
        t0 = time.monotonic()
        while time.monotonic() - t0 < settle_s:
            s = await self.client.cluster_status(timeout=10)
            rows = s.get("workers", [])
            state = {"in_flight": s.get("in_flight", 0),
                     "blocks_held": sum(int(r.get("total_blocks", 0)) - int(r.get("free_blocks", 0))
                                        for r in rows if r.get("role") == "WORKER_ROLE_DECODE"),
                     "queued": sum(int(r.get(k, 0)) for r in rows for k in ("waiting", "running", "receiving",
                                                                          "outstanding_tokens")),
                     "workers_alive": sum(bool(r.get("alive")) for r in rows), "workers": len(rows)}
            if not state["in_flight"] and not state["blocks_held"] and not state["queued"]:
                break
            await asyncio.sleep(0.5)
        return state | {"orphan_workers": len(self.orphans)}

    async def run(self, proxy: FaultProxy) -> dict:
        self.proxy = proxy
        await self.client.wait_ready(30)
        t0 = time.monotonic()
        chaos = asyncio.create_task(self.chaos(t0))
        await self.load(t0)
        await chaos
        await asyncio.gather(*self._checks)
        wall = time.monotonic() - t0
        return {"wall_s": wall, "records": self.records, "faults": self.faults, "storm": self.storm_outcomes,
                "end": await self.end_state(), "proxy": {"connections": proxy.connections,
                                                         "corrupted_chunks": proxy.corrupted_chunks}}


# ---------------------------------------------------------------------------------------------------- the harness
def make_pool(c: SoakConfig) -> tuple[list[dict], list[list[int]]]:
    """``pool`` distinct image requests (prompt text, PNG images, max tokens) and their reference greedy tokens from
    the local engine (no faults, no cluster)."""
    from duet_bench.serve_workload import make_workload
    from engine import LLM, SamplingParams

    llm = LLM(c.model_dir, dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=32)
    arrivals = make_workload(llm.get_tokenizer(), c.pool, 1.0, seed=c.seed, image_fraction=1.0,
                             output_mean=c.output_max / 2, output_max=c.output_max)
    outs = llm.generate([a.prompt for a in arrivals],
                        [SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True) for a in arrivals])
    pool = [{"prompt": a.prompt["prompt"], "images": [_png(i) for i in a.prompt["multi_modal_data"]["image"]],
             "max_tokens": a.max_tokens} for a in arrivals]
    return pool, [o.outputs[0].token_ids for o in outs]


def run_soak(c: SoakConfig) -> dict:
    """Start everything, soak, stop everything (also when the soak raises: no process of the soak's own head, serve
    or workers is left); the raw results (see :func:`duet_bench.chaos.report.summary`)."""
    bad = set(c.faults) - set(FAULTS)
    if bad:
        raise ValueError(f"unknown fault(s) {sorted(bad)} (known: {', '.join(FAULTS)})")
    log_dir = Path(c.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    pool, want = make_pool(c)
    head = ExternalHead(log_dir / "head.log") if "kill_head" in c.faults else LocalHead()
    proxy = FaultProxy(seed=c.seed)
    serve: ServeProcess | None = None

    async def main() -> dict:
        startup_s = await serve.start()
        out = await Soak(c, head, serve, pool, want).run(proxy)
        return out | {"startup_s": startup_s, "serve_starts": serve.starts}

    try:
        head.start()
        config = log_dir / "serve.json"
        config.write_text(json.dumps(spec_fields(c, proxy.address)))
        (log_dir / "serve.log").write_text("")  # this soak's serve processes append to it
        serve = ServeProcess(config, head.address, log_dir / "serve.log", head.env)
        out = asyncio.run(main())
    finally:
        if serve is not None:
            serve.stop()
        proxy.close()
        head.stop()
    return out | {"head": head.describe()}


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait(pred, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    return None

