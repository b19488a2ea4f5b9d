"""Metrics and the autoscaling loop of ``duet serve``.

Unit parts (no Ray): the transfer / cluster / expert collectors over a fake cluster, the GPU collector without a GPU,
and the autoscaler's metrics window. Integration parts on the package's 1 prefill + 1 decode cluster: ``/metrics``
after a request carries the new series with sane values; on a cluster of its own, a server with a tiny policy (TTFT
target 1 ms, no cooldowns, 1 s stabilization window) scales the prefill pool up after a burst, drains it back once
idle, counts both decisions, and leaves no block held.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster.control.autoscale import Action, policy_from_dict
from cluster.serve import ServeConfig, ServerThread
from cluster.serve.autoscaling import MetricsWindow, p90
from cluster.serve.metrics import Metrics
from duet_client import AsyncClient, Client


def _value(text: str, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}`` in a Prometheus text page (labels matched as a subset), or None."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return None


# ------------------------------------------------------------------------------------------------ fakes (no Ray)
@dataclass
class _Load:
    worker_id: str
    alive: bool = True
    free_blocks: int = 0


@dataclass
class _W:
    load: _Load
    prefill_tokens: int = 0


@dataclass
class _FakeCluster:
    experts: dict | None = None
    prefills: list = field(default_factory=lambda: [_W(_Load("prefill-0"), prefill_tokens=300)])
    decodes: list = field(default_factory=lambda: [_W(_Load("decode-0", free_blocks=75)),
                                                   _W(_Load("decode-1", free_blocks=25))])
    total_blocks: dict = field(default_factory=lambda: {"decode-0": 100, "decode-1": 100})

    def status(self) -> list[dict]:
        return [{"worker_id": "prefill-0", "role": "prefill", "alive": True, "outstanding_tokens": 300,
                 "waiting": 2, "running": 1, "free_blocks": 10, "kv_pool_bytes": 1000, "kv_mirror_bytes": 200},
                {"worker_id": "decode-0", "role": "decode", "alive": True, "free_blocks": 75, "receiving": 1,
                 "running": 3, "total_blocks": 100, "kv_pool_bytes": 4000, "kv_mirror_bytes": 3000,
                 "kv_text_bytes": 1500, "kv_visual_bytes": 700},
                {"worker_id": "decode-1", "role": "decode", "alive": False, "total_blocks": 100}]

    def expert_summary(self) -> dict | None:
        return self.experts

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": 1, "decode": 2}

    def healing(self) -> dict:
        return {"respawns": {"prefill": 2, "decode": 1}, "given_up": {"prefill": [], "decode": ["decode-1"]},
                "respawning": []}


def _metrics(cluster: _FakeCluster) -> Metrics:
    m = Metrics(lambda: iter(()), lambda: 0)
    m.attach_cluster(cluster).refresh()
    return m


def test_transfer_series_per_transport():
    m = _metrics(_FakeCluster())
    for nbytes, wire in ((4e9, 1e9), (2e9, 1e9)):
        m.observe_finished({"ttft_s": 0.2, "decode_s": 0.3, "total_s": 0.5, "queue_s": 0.01,
                            "ttft_breakdown": {"prefill_compute_s": 0.15, "decode_commit_s": 0.05},
                            "kv_transfer": {"transport": "gloo", "bytes": nbytes, "wire_bytes": wire,
                                            "seconds": 1.0}}, 10, 4)
    text = m.render().decode()
    assert _value(text, "duet_kv_transport_bytes_total", transport="gloo") == 6e9
    assert _value(text, "duet_kv_transport_wire_bytes_total", transport="gloo") == 2e9
    assert _value(text, "duet_kv_transfer_gbps", transport="gloo") == pytest.approx(3.0)
    assert _value(text, "duet_kv_compression_ratio", transport="gloo") == pytest.approx(3.0)
    assert _value(text, "duet_time_per_output_token_seconds_count") == 2  # TPOT 0.3 / 3 = 0.1 each
    assert _value(text, "duet_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert _value(text, "duet_ttft_stage_seconds_sum", stage="prefill_compute") == pytest.approx(0.3)
    assert _value(text, "duet_ttft_stage_seconds_count", stage="decode_commit") == 2


def test_cluster_series_from_snapshot():
    text = _metrics(_FakeCluster()).render().decode()
    assert _value(text, "duet_pool_workers", pool="decode") == 2
    assert _value(text, "duet_worker_waiting", worker="prefill-0") == 2
    assert _value(text, "duet_prefill_outstanding_tokens", worker="prefill-0") == 300
    assert _value(text, "duet_worker_running", worker="decode-0") == 3
    assert _value(text, "duet_kv_used_blocks", worker="decode-0") == 25
    assert _value(text, "duet_kv_utilization", worker="decode-0") == 0.25
    assert _value(text, "duet_worker_alive", worker="decode-1") == 0
    assert _value(text, "duet_kv_utilization", worker="decode-1") is None  # dead: no stale numbers
    assert _value(text, "duet_kv_pool_bytes", worker="decode-0") == 4000
    assert _value(text, "duet_kv_mirror_bytes", worker="decode-0") == 3000
    assert _value(text, "duet_kv_text_bytes", worker="decode-0") == 1500  # the pool's regions
    assert _value(text, "duet_kv_visual_bytes", worker="decode-0") == 700
    assert _value(text, "duet_kv_memory_bytes") == 8200  # everything attention reads, alive workers
    assert "duet_expert_" not in text  # no expert parallelism nor tiers: no series
    assert _value(text, "duet_worker_respawns_total", role="prefill") == 2
    assert _value(text, "duet_workers_given_up", role="decode") == 1
    assert _value(text, "duet_workers_given_up", role="prefill") == 0


def test_expert_series():
    cluster = _FakeCluster(experts={"placement_changes": 3, "balancedness": 0.8, "prewarm_hits": 90,
                                    "prewarm_misses": 10})
    text = _metrics(cluster).render().decode()
    assert _value(text, "duet_expert_balancedness") == 0.8
    assert _value(text, "duet_expert_placement_changes_total") == 3
    assert _value(text, "duet_expert_prewarm_hit_rate") == pytest.approx(0.9)


def test_decisions_counter_and_gpu_absent_is_silent():
    m = Metrics(lambda: iter(()), lambda: 0)
    m.observe_decision("prefill", +2)
    m.observe_decision("decode", -1)
    m.observe_decision("decode", 0)
    text = m.render().decode()
    assert _value(text, "duet_autoscale_decisions_total", pool="prefill", direction="up") == 1
    assert _value(text, "duet_autoscale_decisions_total", pool="decode", direction="down") == 1
    try:
        import pynvml

        pynvml.nvmlInit()
        has_gpu = pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # noqa: BLE001 - no library, driver or device
        has_gpu = False
    if has_gpu:
        assert 0 < _value(text, "duet_gpu_memory_total_bytes", gpu="0")
        assert 0 <= _value(text, "duet_gpu_utilization_ratio", gpu="0") <= 1
    else:
        assert "duet_gpu_" not in text


def test_gpu_series_from_nvml(monkeypatch):
    """The GPU path with a stand-in pynvml (this machine may have no GPU)."""
    import types

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2 << 30, total=8 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    text = Metrics(lambda: iter(()), lambda: 0).render().decode()
    assert _value(text, "duet_gpu_memory_used_bytes", gpu="0") == 2 << 30
    assert _value(text, "duet_gpu_memory_total_bytes", gpu="0") == 8 << 30
    assert _value(text, "duet_gpu_utilization_ratio", gpu="0") == 0.4


def test_metrics_window():
    assert p90(list(range(1, 11))) == 9 and p90([0.5]) == 0.5
    policy = policy_from_dict({"interval_s": 1, "prefill": {"targets": {"ttft_p90_s": 1.0}},
                               "decode": {"targets": {"tpot_p90_s": 0.1}, "stabilization_window_s": 10}})
    m, now, in_flight = Metrics(lambda: iter(()), lambda: 0), [100.0], [0]
    win = MetricsWindow(_FakeCluster(), m, policy, lambda: in_flight[0], horizon_s=30, clock=lambda: now[0])
    first = win()[-1]
    assert first["ttft_p90_s"] == 0.0 and first["tpot_p90_s"] == 0.0  # idle: under every latency target
    assert first["queued_prefill_tokens"] == 300 and first["kv_utilization"] == pytest.approx(0.5)
    in_flight[0] = 1
    assert win()[-1]["ttft_p90_s"] is None  # busy but nothing finished: no signal
    for i in range(10):
        m.recent.add(0.1 * (i + 1), 0.01, now=95.0)
    m.recent.add(9.0, 9.0, now=60.0)  # older than the horizon
    now[0] = 101.0
    s = win()[-1]
    assert s["ttft_p90_s"] == pytest.approx(0.9) and s["tpot_p90_s"] == 0.01
    now[0] = 402.0  # the longest stabilization window (prefill's default, 300 s) + interval (1 s) later
    assert [x["t"] for x in win()] == [101.0, 402.0]  # older samples dropped


# ------------------------------------------------------------------------------------------- on the real cluster
@pytest.fixture(scope="module")
def server(serve_cluster):
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0, drain_timeout_s=5))
    srv = t.start()
    yield srv
    t.stop()


def test_metrics_after_a_request(server, serve_cluster):
    import httpx

    with Client(server.grpc_target) as c:
        assert c.generate_text("red triangle", max_tokens=4, temperature=0).text
    server.sampler.refresh()
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    transport = serve_cluster.spec.transport
    assert _value(text, "duet_kv_transport_bytes_total", transport=transport) > 0
    assert _value(text, "duet_kv_transfer_gbps", transport=transport) > 0
    assert _value(text, "duet_kv_compression_ratio", transport=transport) >= 1.0
    assert _value(text, "duet_time_per_output_token_seconds_count") >= 1
    assert _value(text, "duet_pool_workers", pool="prefill") == 1
    assert _value(text, "duet_worker_alive", worker="decode-0") == 1
    assert 0 <= _value(text, "duet_kv_utilization", worker="decode-0") <= 1
    assert _value(text, "duet_prefill_outstanding_tokens", worker="prefill-0") >= 0


@pytest.fixture(scope="module")
def scaled_cluster(ray_cluster):
    """A cluster of its own (1 prefill + 1 decode) for the autoscaler to resize: which worker a scale-down drains is
    the cluster's choice, and the shared one must keep its worker ids."""
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from cluster.demo import default_model_dir

    spec = ClusterSpec(model_dir=str(default_model_dir()), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport="gloo",
                       num_kv_blocks=256, cpus_per_worker=1, request_timeout_s=60)
    cluster = DisaggCluster(spec)
    yield cluster
    cluster.shutdown()


def test_autoscaler_scales_prefill_up_on_ttft_breach_then_drains_it_when_idle(scaled_cluster, tmp_path: Path):
    from tests.cluster.serve.conftest import wait_idle

    policy = tmp_path / "tiny.yaml"
    policy.write_text("interval_s: 0.2\n"
                      "prefill: {min_workers: 1, max_workers: 2, targets: {ttft_p90_s: 0.001},\n"
                      "          scale_up_cooldown_s: 0, scale_down_cooldown_s: 0, stabilization_window_s: 1.0}\n"
                      "decode: {min_workers: 1, max_workers: 1, targets: {tpot_p90_s: 100}}\n")
    assert scaled_cluster.pool_sizes() == {"prefill": 1, "decode": 1}
    t = ServerThread(scaled_cluster, ServeConfig(grpc_port=0, http_port=0, drain_timeout_s=5,
                                                autoscaling_policy=str(policy)))
    srv = t.start()
    srv.autoscale.window.horizon_s = 2.0  # the burst's latencies age out quickly, so the idle pool shrinks soon

    def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < end, what
            time.sleep(0.1)

    def decisions(pool: str, direction: str) -> float | None:
        return _value(srv.service.metrics.render().decode(), "duet_autoscale_decisions_total", pool=pool,
                      direction=direction)

    try:
        async def burst() -> list[tuple[str, int]]:
            async with AsyncClient(srv.grpc_target) as ac:
                done = await asyncio.gather(*(ac.generate_text(f"red triangle {i}", max_tokens=4, ignore_eos=True)
                                              for i in range(4)))
            return [(d.finish_reason, d.usage.completion_tokens) for d in done]

        # each served in full (ignore_eos: the demo may answer a bare text prompt with its end token at once)
        assert asyncio.run(burst()) == [("length", 4)] * 4
        wait_for(lambda: decisions("prefill", "up") == 1, "the prefill pool did not grow")
        assert decisions("decode", "up") is None  # decode follows its own targets
        # idle after the horizon: every sample under scale_down_ratio x target for the window -> drain, once
        wait_for(lambda: decisions("prefill", "down") == 1, "the idle prefill pool did not shrink")
        wait_for(lambda: len(scaled_cluster.prefills) == 1, "the drained worker was not removed", 60)
        assert decisions("prefill", "up") == 1  # no flapping
        changes = [(d.prefill.action, d.prefill.delta, d.decode.action) for _, d in srv.autoscale.autoscaler.history]
        assert changes == [(Action.ADD, 1, Action.HOLD), (Action.DRAIN, -1, Action.HOLD)]
        with Client(srv.grpc_target) as c:
            assert c.generate_text("blue circle", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
    finally:
        t.stop()
        assert not srv.autoscale._thread.is_alive()  # stopped with the server
    assert scaled_cluster.pool_sizes() == {"prefill": 1, "decode": 1}
    wait_idle(scaled_cluster)
    held = scaled_cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held
