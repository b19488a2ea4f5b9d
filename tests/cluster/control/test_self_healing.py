"""Self-healing pools on a local Ray cluster (:mod:`cluster.control.pool_healer`): killed workers are replaced while
requests keep arriving, a crash-looping worker is given up, and an expert-parallel group that loses a member is
re-formed. Every request ends correct (greedy tokens equal the local engine's) or with a typed error, every wait has
a deadline, and no worker holds a KV block afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from engine import LLM
from duet_client._proto.duet.v1 import duet_pb2 as pb
from engine.errors import DuetError
from tests.conftest import greedy, make_image, make_request

SMALL = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, cpus_per_worker=1,
             request_timeout_s=60, transport="gloo", health_ping_s=0.5, health_ping_timeout_s=10)
RECOVER_S = 30.0


def _local(model_dir, prompts, params):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _start(cluster, prompt, params):
    return asyncio.run_coroutine_threadsafe(cluster._collect(prompt, params), cluster._loop)


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def _wait(pred, timeout_s: float, what: str) -> float:
    """Poll ``pred`` until true; returns the seconds it took (fails at the deadline)."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _full(cluster, n_prefill: int, n_decode: int) -> bool:
    rows = cluster.status(timeout_s=5)
    alive = {role: sum(r["alive"] for r in rows if r["role"] == role) for role in ("prefill", "decode")}
    return alive == {"prefill": n_prefill, "decode": n_decode} and len(rows) == n_prefill + n_decode


def _grpc_status(cluster):
    """What the gRPC ``ClusterStatus`` of a server over ``cluster`` answers."""
    from cluster.serve.grpc_api import status_to_proto
    from cluster.serve.limits import Limits
    from cluster.serve.service import InferenceService

    service = InferenceService(cluster, Limits(), "demo")
    try:
        return status_to_proto(asyncio.run(service.status()))
    finally:
        service.close()


def _assert_idle(cluster):
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held


def test_killed_prefill_and_decode_are_replaced_under_open_loop_load(ray_cluster, tiny_model_dir):
    c = DisaggCluster(ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                                  num_prefill=2, num_decode=2, **SMALL))
    try:
        prompts = [make_request(6 + i % 5, seed=100 + i, images=[make_image(i % 3)] * (i % 2)) for i in range(24)]
        params = [greedy(4 + i % 4) for i in range(24)]
        want = _local(tiny_model_dir, prompts, params)
        decode_pid = _pid(c.decodes[0].actor)
        futs, killed_at = [], None
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):  # open loop: ~8 req/s, kills mid-stream
            futs.append(_start(c, p, sp))
            if i == 8:
                import ray

                ray.kill(c.prefills[0].actor)
                os.kill(decode_pid, signal.SIGKILL)
                killed_at = time.monotonic()
            time.sleep(0.125)
        ok = failed = 0
        for f, w in zip(futs, want, strict=True):
            try:
                got = f.result(timeout=120)  # never hung: each request has its own deadline too
            except DuetError:
                failed += 1
                continue
            assert got.token_ids == w
            ok += 1
        assert ok >= 16, (ok, failed)
        took = _wait(lambda: _full(c, 2, 2), RECOVER_S - (time.monotonic() - killed_at), "pools back at full size")
        print(f"pools full {time.monotonic() - killed_at:.1f} s after the kills ({took:.1f} s after the load); "
              f"{ok} ok, {failed} failed typed")
        h = c.healing()
        assert h["respawns"] == {"prefill": 1, "decode": 1} and h["given_up"] == {"prefill": [], "decode": []}
        assert c.pool_sizes() == {"prefill": 2, "decode": 2}
        assert {w.load.worker_id for w in c.prefills + c.decodes}.isdisjoint({"prefill-0", "decode-0"})
        got = c.generate_batch(prompts[:4], params[:4])  # the replacements serve
        assert [g.token_ids for g in got] == want[:4]
        _assert_idle(c)
    finally:
        c.shutdown()


def test_a_crash_looping_worker_is_given_up(ray_cluster, tiny_model_dir):
    import ray

    from cluster.serve.metrics import Metrics

    c = DisaggCluster(ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                                  num_prefill=1, num_decode=1, **SMALL))
    try:
        for n in range(3):  # three deaths inside respawn_window_s (60 s)
            ray.kill(c.prefills[0].actor)
            if n < 2:
                _wait(lambda n=n: c.healing()["respawns"]["prefill"] == n + 1 and _full(c, 1, 1), RECOVER_S,
                      f"respawn {n + 1}")
        _wait(lambda: c.healing()["given_up"]["prefill"], 10, "give up")
        row = next(r for r in c.status() if r["role"] == "prefill")
        assert not row["alive"] and row["healing"] == "given_up"
        assert c.pool_sizes()["prefill"] == 0  # not counted: the autoscaler sees the pool short
        time.sleep(1.5)  # several scan and ping rounds: still no respawn
        assert c.healing()["respawns"]["prefill"] == 2
        m = Metrics(lambda: iter(()), lambda: 0)
        m.attach_cluster(c).refresh()
        text = m.render().decode()
        assert 'duet_workers_given_up{role="prefill"} 1.0' in text
        assert 'duet_worker_respawns_total{role="prefill"} 2.0' in text
        st = _grpc_status(c)  # the gRPC ClusterStatus says so too
        gone = [w for w in st.workers if w.role == pb.WORKER_ROLE_PREFILL]
        assert len(gone) == 1 and not gone[0].alive and gone[0].healing == pb.WORKER_HEALING_GIVEN_UP
        assert list(st.healing.given_up) == [gone[0].worker_id] and st.healing.prefill_respawns == 2
        assert all(w.healing == pb.WORKER_HEALING_UNSPECIFIED for w in st.workers if w.alive)
        with pytest.raises(DuetError):  # typed, at once: no prefill worker left
            c.generate_batch([make_request(5, seed=1)], greedy(2), timeout_s=30)
    finally:
        c.shutdown()


def test_expert_parallel_group_that_loses_a_member_is_re_formed(ray_cluster, tiny_model_dir):
    import ray

    spec = ClusterSpec(model_dir=str(tiny_model_dir), num_prefill=1, num_decode=2, expert_parallel=2,
                       expert_slots_per_worker=5, expert_rebalance_s=0, expert_group_timeout_s=20, **SMALL)
    c = DisaggCluster(spec)
    try:
        prompt, sp = make_request(7, seed=9), greedy(5)
        want = _local(tiny_model_dir, [prompt], [sp])[0]
        assert c.generate_batch([prompt], sp)[0].token_ids == want
        t0 = time.monotonic()
        ray.kill(c.decodes[1].actor)
        took = _wait(lambda: c.healing()["respawns"]["decode"] == 2 and _full(c, 1, 2), RECOVER_S, "group back")
        print(f"expert-parallel group re-formed {took:.1f} s after the kill ({time.monotonic() - t0:.1f})")
        assert [w.load.worker_id for w in c.decodes] == ["decode-2", "decode-3"]
        assert c.pool_sizes()["decode"] == 2 and len(c.expert_routers) == 1
        assert c.generate_batch([prompt], sp)[0].token_ids == want
        _assert_idle(c)
    finally:
        c.shutdown()
