"""cluster.control.autoscale: policy validation and decisions on recorded metric traces (tests/cluster/control/traces/*.json, one
sample every 10 s), replayed through the Autoscaler loop with fake pool hooks and a trace clock."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from cluster.control.autoscale import (
    Action,
    Autoscaler,
    Decision,
    PolicyError,
    PoolDecision,
    ScaleState,
    decide,
    load_policy,
    policy_from_dict,
)

ROOT = Path(__file__).resolve().parents[3]
TRACES = Path(__file__).parent / "traces"
POLICIES = sorted((ROOT / "deploy" / "autoscaling").glob("*.yaml"))


class FakePools:
    """PoolHooks over plain counters; records every call."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)
        self.calls: list[tuple[str, str]] = []

    def pool_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def add_worker(self, role: str) -> str:
        self.sizes[role] += 1
        self.calls.append(("add", role))
        return f"{role}-{self.sizes[role]}"

    def drain_worker(self, role: str) -> str:
        self.sizes[role] -= 1
        self.calls.append(("drain", role))
        return f"{role}-{self.sizes[role] + 1}"


def replay(name: str, policy=None) -> tuple[list[tuple[float, Decision, dict]], FakePools]:
    """Step the autoscaler at every sample of trace ``name``; returns (t, decision, sizes after) per step."""
    trace = json.loads((TRACES / f"{name}.json").read_text())
    policy = policy or load_policy(ROOT / trace["policy"])
    pools = FakePools(trace["initial_sizes"])
    samples, now = trace["samples"], [0.0]
    scaler = Autoscaler(policy, pools, lambda: [s for s in samples if now[0] - 900 <= s["t"] <= now[0]],
                        clock=lambda: now[0])
    steps = []
    for s in samples:
        now[0] = s["t"]
        steps.append((s["t"], scaler.step(), pools.pool_sizes()))
    return steps, pools


def changes(steps, role: str) -> list[tuple[float, PoolDecision]]:
    return [(t, getattr(d, role)) for t, d, _ in steps if getattr(d, role).action is not Action.HOLD]


# ------------------------------------------------------------------------------------------------------ traces
def test_scales_prefill_up_within_one_cooldown_of_a_ttft_breach() -> None:
    steps, _ = replay("ttft_spike")
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    ups = changes(steps, "prefill")
    assert ups, "no scale-up"
    t0, first = ups[0]
    assert 50 <= t0 <= 50 + policy.prefill.scale_up_cooldown_s
    assert first.action is Action.ADD and first.delta == 2 and "ttft_p90_s" in first.reason  # ceil(2 * 1.6) - 2
    assert all(b[0] - a[0] >= policy.prefill.scale_up_cooldown_s for a, b in itertools.pairwise(ups))
    assert not changes(steps, "decode"), "decode must not follow prefill's signal"


def test_scales_decode_on_tpot_then_kv_independently_of_prefill() -> None:
    steps, pools = replay("decode_pressure")
    ups = changes(steps, "decode")
    assert [d.action for _, d in ups] == [Action.ADD] * len(ups) and len(ups) >= 2
    assert ups[0][0] == 40 and "tpot_p90_s" in ups[0][1].reason
    assert any(t >= 150 and "kv_utilization" in d.reason for t, d in ups)
    assert not changes(steps, "prefill")
    assert pools.sizes["prefill"] == 2


def test_does_not_flap_inside_the_stabilization_window() -> None:
    steps, _ = replay("oscillating")
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    window = policy.prefill.stabilization_window_s
    moves = changes(steps, "prefill")
    assert any(d.action is Action.ADD for _, d in moves)
    for (ta, a), (tb, b) in itertools.pairwise(moves):
        if a.action is Action.ADD and b.action is Action.DRAIN:
            assert tb - ta >= window, f"drained at {tb} s, {tb - ta} s after growing at {ta} s"
    # the quiet halves never last a whole window, so nothing is ever drained
    assert all(d.action is Action.ADD for _, d in moves)


def test_scales_down_only_after_the_window_and_drains_decode() -> None:
    steps, pools = replay("quiet")
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    for role in ("prefill", "decode"):
        pp = policy.pool(role)
        downs = changes(steps, role)
        assert downs and all(d.action is Action.DRAIN and d.delta == -1 for _, d in downs)
        assert downs[0][0] >= pp.stabilization_window_s
        assert all(b[0] - a[0] >= pp.scale_down_cooldown_s for a, b in itertools.pairwise(downs))
        assert pools.sizes[role] == pp.min_workers  # 30 quiet minutes take both pools to their floor
    assert ("drain", "decode") in pools.calls and ("add", "decode") not in pools.calls


def test_respects_max_workers_under_overload() -> None:
    steps, pools = replay("overload")
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    for role in ("prefill", "decode"):
        sizes = [s[role] for _, _, s in steps]
        assert max(sizes) == policy.pool(role).max_workers == pools.sizes[role]
        assert sizes == sorted(sizes)  # never shrinks under overload
        for _, d in changes(steps, role):
            assert 1 <= d.delta <= policy.pool(role).max_step_up
    last = steps[-1][1].prefill
    assert last.action is Action.HOLD and "max_workers" in last.reason


# ------------------------------------------------------------------------------------------------------ decide()
def sample(t: float, **m) -> dict:
    return {"t": t, **m}


def test_min_workers_and_empty_window() -> None:
    policy = load_policy(ROOT / "deploy/autoscaling/latency.yaml")  # prefill min 2, decode min 4
    d = decide(policy, [], {"prefill": 1, "decode": 4}, ScaleState(), 0.0)
    assert d.prefill == PoolDecision("prefill", Action.ADD, 1, "below min_workers 2")
    assert d.decode.action is Action.HOLD and d.decode.reason == "no metrics"


def test_queued_tokens_target_is_per_worker() -> None:
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")  # 16384 queued tokens per prefill worker
    window = [sample(0, queued_prefill_tokens=30000)]
    assert decide(policy, window, {"prefill": 2, "decode": 1}, ScaleState(), 0).prefill.action is Action.HOLD
    up = decide(policy, window, {"prefill": 1, "decode": 1}, ScaleState(), 0).prefill
    assert up.action is Action.ADD and up.delta == 1  # ceil(1 * 30000 / 16384) - 1


def test_missing_metrics_give_no_signal_and_block_scale_down() -> None:
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    window = [sample(t, ttft_p90_s=0.1) for t in range(0, 700, 10)]  # decode metrics never reported
    d = decide(policy, window, {"prefill": 3, "decode": 3}, ScaleState(), 690)
    assert d.prefill.action is Action.HOLD and "queued_prefill_tokens" in d.prefill.reason
    assert d.decode.action is Action.HOLD


def test_state_after_records_changes() -> None:
    d = Decision(PoolDecision("prefill", Action.ADD, 1, "x"), PoolDecision("decode", Action.DRAIN, -1, "y"))
    s = ScaleState().after(d, 42.0)
    assert s.last_up == {"prefill": 42.0, "decode": None} and s.last_down == {"prefill": None, "decode": 42.0}


# ------------------------------------------------------------------------------------------------------ policies
@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_shipped_policies_load(path: Path) -> None:
    policy = load_policy(path)
    assert policy.prefill.targets and policy.decode.targets


def _default() -> dict:
    return yaml.safe_load((ROOT / "deploy/autoscaling/default.yaml").read_text())


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["prefill"].update(min_workers=5, max_workers=2), "prefill.min_workers/max_workers"),
    (lambda d: d["decode"]["targets"].update(ttft_p90_s=1.0), "unknown target decode.targets.ttft_p90_s"),
    (lambda d: d["decode"]["targets"].update(kv_utilization=1.5), "decode.targets.kv_utilization"),
    (lambda d: d["prefill"].update(cooldown=3), "unknown setting prefill.cooldown"),
    (lambda d: d["prefill"].update(max_step_up=1.5), "prefill.max_step_up: expected an integer"),
    (lambda d: d["decode"].update(scale_down_ratio=1.0), "decode.scale_down_ratio"),
    (lambda d: d["decode"].update(targets={}), "decode.targets: give at least one"),
    (lambda d: d.pop("decode"), "decode: must be a mapping"),
    (lambda d: d.update(interval_s=0), "interval_s must be > 0"),
], ids=["min>max", "wrong-pool-target", "kv>1", "unknown-key", "float-step", "ratio", "no-targets", "no-decode",
        "interval"])
def test_bad_policies_name_the_field(edit, message: str) -> None:
    data = _default()
    edit(data)
    with pytest.raises(PolicyError, match=message.replace(".", r"\.")):
        policy_from_dict(data)


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("prefill: [1, 2]\n")
    with pytest.raises(PolicyError, match=r"p\.yaml: prefill: must be a mapping"):
        load_policy(bad)
    with pytest.raises(PolicyError, match="not found"):
        load_policy(tmp_path / "missing.yaml")


def test_decide_is_pure() -> None:
    policy = load_policy(ROOT / "deploy/autoscaling/default.yaml")
    window = [sample(0, ttft_p90_s=2.0, tpot_p90_s=0.2)]
    state = ScaleState()
    a = decide(policy, window, {"prefill": 2, "decode": 2}, state, 100.0)
    assert a == decide(policy, window, {"prefill": 2, "decode": 2}, state, 100.0)
    assert state == ScaleState() and window == [sample(0, ttft_p90_s=2.0, tpot_p90_s=0.2)]
    cooled = decide(policy, window, {"prefill": 2, "decode": 2}, replace(state.after(a, 90.0)), 100.0)
    assert cooled.prefill.action is Action.HOLD and "cooldown" in cooled.prefill.reason


# ------------------------------------------------------------------------------------------------------ cluster hooks
def test_cluster_hooks_add_and_drain_lose_no_request(ray_cluster, tiny_model_dir: Path) -> None:
    """The Autoscaler adds a decode worker through the cluster's hooks; draining a decode worker mid-decode lets its
    running requests finish (no retry), routes new ones to the other, then removes it with no KV block held."""
    import asyncio
    import time

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from engine.errors import InvalidRequestError
    from tests.conftest import greedy, make_request

    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport="gloo",
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, request_timeout_s=60)
    c = DisaggCluster(spec)
    try:
        with pytest.raises(InvalidRequestError, match="last decode worker"):
            c.drain_worker("decode")
        # the loop adds a decode worker on a TPOT breach through the cluster's hooks
        scaler = Autoscaler(load_policy(ROOT / "deploy/autoscaling/default.yaml"), c,
                            lambda: [sample(0, tpot_p90_s=0.06)], clock=lambda: 0.0)
        assert scaler.step().decode == PoolDecision("decode", Action.ADD, 1, "tpot_p90_s 0.06 > 0.05")
        assert c.pool_sizes() == {"prefill": 1, "decode": 2} and c.decodes[-1].load.worker_id == "decode-1"
        futs = [asyncio.run_coroutine_threadsafe(c._collect(make_request(6 + i, seed=i), greedy(24)), c._loop)
                for i in range(2)]
        end = time.monotonic() + 30
        while not any(w.inflight for w in c.decodes) and time.monotonic() < end:
            time.sleep(0.01)
        busy = next(w for w in c.decodes if w.inflight)
        other = next(w.load.worker_id for w in c.decodes if w is not busy)
        victim = c.drain_worker("decode", busy.load.worker_id)  # it has running requests
        assert c.pool_sizes()["decode"] == 1
        late = c.generate_batch([make_request(5, seed=9)], greedy(3))[0]  # placed while the victim drains
        got = [f.result(timeout=60) for f in futs]
        c.wait_drained(victim, timeout_s=30)
        assert victim in {g.timeline["decode_worker"] for g in got}
        assert all(len(g.token_ids) == 24 and g.attempts == 1 for g in got)
        assert late.attempts == 1 and late.timeline["decode_worker"] == other
        assert [w.load.worker_id for w in c.decodes] == [other]
        assert all(v == 0 for v in c.check_no_leaks().values())
    finally:
        c.shutdown()
