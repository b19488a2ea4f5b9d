"""The planner check of ``duet bench serve``: the simulated latencies of a run's own requests."""

from __future__ import annotations

import numpy as np
import pytest

from duet_bench.serve_predict import calibrate, errors, predict, requests_of, within
from duet_bench.serve_workload import Arrival
from cluster.planner.planner import Profile


def _arrivals(times, outs, images=()):
    return [Arrival(t, {"prompt": "x", **({"multi_modal_data": {"image": [None] * images[i]}}
                                          if i < len(images) and images[i] else {})}, o, "text")
            for i, (t, o) in enumerate(zip(times, outs, strict=True))]


def test_requests_keep_the_run_s_arrivals_lengths_and_images():
    arr = _arrivals([0.5, 1.0, 3.0], [4, 1, 9], images=[0, 2, 1])
    req = requests_of(arr, [10, 600, 300], rate=2.0)
    assert req.unit_arrivals.tolist() == [1.0, 2.0, 6.0]  # the simulators divide by the rate
    assert req.prompt.tolist() == [10, 600, 300] and req.images.tolist() == [0, 2, 1]
    assert req.output.tolist() == [4, 1, 9]


def test_calibration_fits_the_path_s_prefill_scale_and_latency():
    prof = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-3, decode_base_s=0.01)
    tokens = [50, 100, 200, 300, 400]
    engine = [0.01 + 1e-3 * n for n in tokens]
    ttfts = [0.08 + 1.5 * e for e in engine]  # the path: 1.5x slower prefill, 80 ms of latency
    tpots = [0.009 + 2e-6 * n for n in tokens]  # one-sequence steps on the path: 9 ms + 2 us per context token
    tpots[2] = None  # a one-token output has no TPOT
    got = calibrate(prof, ttfts, tpots, tokens, [0] * 5)
    assert got.prefill_per_token_s == pytest.approx(1.5e-3) and got.prefill_base_s == pytest.approx(0.015)
    assert got.transfer_base_s == pytest.approx(0.08) and got.transfer_exposed_fraction == 1.0
    assert got.decode_per_ctx_token_s == pytest.approx(2e-6) and got.decode_base_s == pytest.approx(0.009)
    fast = calibrate(prof, engine, [None] * 5, tokens, [0] * 5)  # a path no slower than the engine: nothing added
    assert fast.prefill_per_token_s == pytest.approx(1e-3) and fast.transfer_base_s == pytest.approx(0, abs=1e-9)
    assert fast.decode_base_s == 0.01
    same = calibrate(prof, [0.2, 0.3], [None] * 2, [100, 100], [0, 0])  # one prompt size: latency only
    assert same.prefill_per_token_s == 1e-3 and same.transfer_base_s == pytest.approx(0.14)
    # the worker's busy time separates its serialised work (x1.2 here) from latency the worker is not busy for
    busy = [1.2 * e for e in engine]
    split = calibrate(prof, ttfts, [None] * 5, tokens, [0] * 5, service=busy)
    assert split.prefill_per_token_s == pytest.approx(1.2e-3)
    # what is left, 0.08 + 0.3 * (0.01 + 1e-3 n), is a latency of 83 ms + 0.3 ms per prompt token
    assert split.transfer_base_s == pytest.approx(0.083) and split.transfer_per_token_s == pytest.approx(3e-4)
    assert split.prefill_base_s == pytest.approx(0.012)  # the scaled engine base; no fixed occupancy
    # CPU time with 20 ms per request whatever its size (taking it in): the worker's base grows by it, the latency
    # shrinks by it, TTFT stays what was measured
    cpu = [0.02 + 1.2 * e for e in engine]
    occ = calibrate(prof, ttfts, [None] * 5, tokens, [0] * 5, service=cpu)
    assert occ.prefill_per_token_s == pytest.approx(1.2e-3) and occ.prefill_base_s == pytest.approx(0.032)
    assert occ.transfer_base_s == pytest.approx(0.063) and occ.transfer_per_token_s == pytest.approx(3e-4)
    assert occ.decode_join_base_s == 0 and occ.decode_join_per_token_s == 0  # not measured: free
    # the decode worker's time per request beyond its steps: 4 ms + 10 us per prompt token
    joined = calibrate(prof, ttfts, [None] * 5, tokens, [0] * 5, join=[0.004 + 1e-5 * n for n in tokens])
    assert joined.decode_join_base_s == pytest.approx(0.004) and joined.decode_join_per_token_s == pytest.approx(1e-5)
    n = np.array(tokens)
    assert occ.prefill_s(n, np.zeros(5)) + occ.exposed_transfer_s(n) == pytest.approx(ttfts)
    # the intake's share of each probe's TPOT (11 intervals of 12 tokens) is taken out of the fitted step: the
    # simulated worker charges the intake again
    intake = [0.004 + 1e-5 * n for n in tokens]
    with_intake = [None if t is None else t + j / 11 for t, j in zip(tpots, intake, strict=True)]
    shared = calibrate(prof, ttfts, with_intake, tokens, [0] * 5, join=intake, outputs=[12] * 5)
    assert shared.decode_per_ctx_token_s == pytest.approx(2e-6) and shared.decode_base_s == pytest.approx(0.009)


def test_prediction_far_apart_is_service_time_and_colocated_tpot_grows_with_prefill_interference():
    prof = Profile(prefill_base_s=0.2, prefill_per_token_s=0.0, decode_base_s=0.01, transfer_base_s=0.03)
    lone = requests_of(_arrivals([10.0 * i for i in range(20)], [11] * 20), [100] * 20, rate=1.0)
    p = predict(prof, prof, lone, 1.0)
    assert p["disaggregated"]["ttft_s"]["p50"] == pytest.approx(0.23)
    assert p["disaggregated"]["tpot_s"]["p90"] == pytest.approx(0.01, rel=0.05)
    assert p["colocated"]["tpot_s"]["p90"] == pytest.approx(0.01, rel=0.05)
    # one arrival every 0.25 s: a colocated engine stops decoding for each 0.2 s prefill, a decode worker never does
    busy = requests_of(_arrivals([0.25 * i for i in range(40)], [41] * 40), [100] * 40, rate=1.0)
    p = predict(prof, prof, busy, 1.0)
    assert p["disaggregated"]["tpot_s"]["p90"] == pytest.approx(0.01, rel=0.05)
    assert p["colocated"]["tpot_s"]["p90"] > 3 * p["disaggregated"]["tpot_s"]["p90"]


def test_errors_and_tolerance():
    pct = lambda p50, p90: {"p50": p50, "p90": p90, "p99": None}
    pred = {"disaggregated": {"ttft_s": pct(1.1, 2.0), "tpot_s": pct(0.01, 0.02)},
            "colocated": {"ttft_s": pct(1.0, 1.0), "tpot_s": pct(None, 0.1)}}
    meas = {"disaggregated": {"ttft_s": pct(1.0, 1.6), "tpot_s": pct(0.01, 0.02)},
            "colocated": {"ttft_s": pct(0.5, 1.0), "tpot_s": pct(0.01, 0.0)}}
    e = errors(pred, meas)
    assert e["disaggregated.ttft_s.p50"] == pytest.approx(0.1) and e["disaggregated.ttft_s.p90"] == pytest.approx(0.25)
    assert e["colocated.tpot_s.p50"] is None and e["colocated.tpot_s.p90"] is None  # nothing to compare
    assert within(e) is True and within(e, "colocated") is False
    assert within(e, tol=0.2) is False and within({}, "disaggregated") is None
    assert np.isfinite(e["colocated.ttft_s.p50"])
