"""The planner (:mod:`cluster.planner.planner`): hand-checkable simulations, pool sizing direction, mode choice, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster.cli.main import main
from cluster.planner.planner import (
    SLO,
    Mode,
    PlanError,
    Profile,
    Requests,
    Workload,
    plan,
    simulate_colocated_gpu,
    simulate_decode_worker,
    simulate_prefill_pool,
)

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "deploy" / "profiles" / "h100-moe-assumed.json"
# prefill 1 ms/token, decode 20 ms/step whatever the batch, transfer free
FLAT = Profile(prefill_per_token_s=1e-3, decode_base_s=0.02, max_decode_batch=64)


def _requests(arrivals, prompt, output, images=None) -> Requests:
    n = len(arrivals)
    return Requests(np.asarray(arrivals, float), np.full(n, prompt) if np.isscalar(prompt) else np.asarray(prompt),
                    np.zeros(n, int) if images is None else np.asarray(images), np.full(n, output))


def test_an_idle_system_adds_no_queueing():
    req = _requests([0.0, 10.0, 20.0], 100, 5)
    prof = Profile(prefill_per_token_s=1e-3, decode_base_s=0.02, transfer_per_token_s=1e-4)
    np.testing.assert_allclose(simulate_prefill_pool(prof, req, 1.0, 1), 0.1 + 0.01)  # prefill + transfer
    np.testing.assert_allclose(simulate_decode_worker(prof, req.unit_arrivals, req.prompt, req.output), 0.02)
    ttft, tpot = simulate_colocated_gpu(FLAT, req, 1.0)
    np.testing.assert_allclose(ttft, 0.1)
    np.testing.assert_allclose(tpot, 0.02)


def test_decode_step_cost_grows_with_batch_and_context():
    prof = Profile(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_token_s=1e-5)
    # two sequences of 10 prompt tokens join together and run 2 steps: contexts 20 then 22 tokens
    tpot = simulate_decode_worker(prof, np.zeros(2), np.array([10, 10]), np.array([3, 3]))
    np.testing.assert_allclose(tpot, ((0.012 + 20e-5) + (0.012 + 22e-5)) / 2)


def test_prefill_interrupts_colocated_decode():
    # request 0 decodes; request 1 (1000 tokens = 1 s of prefill) arrives mid-decode and stalls it
    req = _requests([0.0, 0.15], [10, 1000], 11)
    _, tpot = simulate_colocated_gpu(FLAT, req, 1.0)
    assert tpot[0] > 0.09  # ten 20 ms steps plus a 1 s stall, over 10 tokens
    prefill_only = simulate_decode_worker(FLAT, np.array([0.01]), np.array([10]), np.array([11]))
    assert prefill_only[0] == pytest.approx(0.02)


def test_colocated_steps_mix_prompts_and_decodes_within_the_token_budget():
    # two 100-token prompts arriving together share one step (both first tokens at 0.2 s) unless the budget splits them
    req = _requests([0.0, 0.0], 100, 3)
    ttft, tpot = simulate_colocated_gpu(FLAT, req, 1.0)
    np.testing.assert_allclose(ttft, [0.2, 0.2])
    np.testing.assert_allclose(tpot, 0.02)
    ttft, _ = simulate_colocated_gpu(FLAT, req, 1.0, max_batched_tokens=150)
    np.testing.assert_allclose(ttft, [0.1, 0.2 + 0.02])  # the second prompt's step also decodes the first's token
    # a decoding sequence gets its token in the step that prefills a newcomer: 0.01 prefill, decode 0.01-0.03, then
    # the 1000-token prompt's step (1 s + the 20 ms decode) and 8 more decode steps -> (1.21 - 0.01) / 10
    _, tpot = simulate_colocated_gpu(FLAT, _requests([0.0, 0.015], [10, 1000], 11), 1.0)
    assert tpot[0] == pytest.approx(0.12)


def test_single_prefill_worker_matches_md1_queueing():
    """One prompt per step: M/D/1, mean wait = rho * s / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    s, rho = 0.1, 0.6
    req = Workload(prompt_mean=100).sample(40_000, seed=3)
    ttft = simulate_prefill_pool(FLAT, req, rho / s, 1, max_batched_tokens=1)
    assert ttft.mean() == pytest.approx(s + rho * s / (2 * (1 - rho)), rel=0.05)
    # batched steps (the engine's): the queue is served as fast, but a prompt waits for the others in its step
    batched = simulate_prefill_pool(FLAT, req, rho / s, 1)
    assert ttft.mean() < batched.mean() < 1.5 * ttft.mean()


def test_prompts_waiting_for_a_prefill_worker_share_its_next_step():
    # 1 ms/token: A (500 tokens) at 0 runs alone; B and C (300, 200) arrive during it and run together after it, both
    # ready at its end; D (4000) does not fit the 4096-token budget beside them and runs alone
    req = _requests([0.0, 0.1, 0.2, 0.3], [500, 300, 200, 4000], 2)
    ttft = simulate_prefill_pool(FLAT, req, 1.0, 1)
    assert ttft.tolist() == pytest.approx([0.5, 1.0 - 0.1, 1.0 - 0.2, 5.0 - 0.3])
    one_at_a_time = simulate_prefill_pool(FLAT, req, 1.0, 1, max_batched_tokens=1)
    assert one_at_a_time.tolist() == pytest.approx([0.5, 0.8 - 0.1, 1.0 - 0.2, 5.0 - 0.3])


def test_shortest_policy_gives_short_prompts_their_own_step():
    # 1 ms/token: A (500) runs alone; B (4000), C (200) and D (300) wait for it. Shortest first: C and D share the
    # next step (B is more than twice their tokens), then B. FCFS: B first (C does not fit its budget), then C and D.
    req = _requests([0.0, 0.1, 0.2, 0.3], [500, 4000, 200, 300], 2)
    shortest = simulate_prefill_pool(FLAT, req, 1.0, 1, policy="shortest")
    assert shortest.tolist() == pytest.approx([0.5, 5.0 - 0.1, 1.0 - 0.2, 1.0 - 0.3])
    fcfs = simulate_prefill_pool(FLAT, req, 1.0, 1)
    assert fcfs.tolist() == pytest.approx([0.5, 4.5 - 0.1, 5.0 - 0.2, 5.0 - 0.3])
    assert shortest.mean() < fcfs.mean()
    with pytest.raises(ValueError, match="policy"):
        simulate_prefill_pool(FLAT, req, 1.0, 1, policy="lifo")


def test_two_prefill_workers_never_start_a_prompt_before_it_arrives():
    req = _requests([0.0, 5.0, 5.0, 5.0], 100, 2)
    ttft = simulate_prefill_pool(FLAT, req, 1.0, 2, max_batched_tokens=100)
    assert ttft.min() >= 0.1 - 1e-9
    assert sorted(ttft.tolist()) == pytest.approx([0.1, 0.1, 0.1, 0.2])


def test_worked_example_prefill_bound():
    p = plan(FLAT, Workload(prompt_mean=1000, output_mean=50), SLO(ttft_p90_s=2.0, tpot_p90_s=0.05), 8)
    assert (p.prefill, p.decode) == (7, 1)
    assert p.recommended is Mode.DISAGGREGATED


def test_prefill_heavy_gets_more_prefill_and_decode_heavy_more_decode():
    prof = Profile(prefill_per_token_s=1e-4, decode_base_s=0.02, decode_per_seq_s=1e-3, max_decode_batch=32)
    slo = SLO(ttft_p90_s=1.0, tpot_p90_s=0.1)
    heavy_prefill = plan(prof, Workload(prompt_mean=4000, output_mean=8), slo, 16, requests_per_worker=300)
    heavy_decode = plan(prof, Workload(prompt_mean=64, output_mean=512), slo, 16, requests_per_worker=300)
    assert heavy_prefill.prefill > heavy_prefill.decode
    assert heavy_decode.decode > heavy_decode.prefill


def test_colocated_wins_short_prompts_at_low_load():
    p = plan(FLAT, Workload(rate=0.5, prompt_mean=32, output_mean=32), SLO(2.0, 0.1), 8, requests_per_worker=300)
    assert p.recommended is Mode.COLOCATED
    assert p.needed["colocated_gpus"] == 1 and p.needed["disaggregated_gpus"] == 2


def test_disaggregated_wins_when_long_prompts_stall_decode():
    # a 2000-token prefill (2 s) would stall every colocated decode far past a 60 ms TPOT target
    p = plan(FLAT, Workload(rate=2.0, prompt_mean=2000, prompt_cv=0.5, output_mean=64), SLO(10.0, 0.06), 16,
             requests_per_worker=300)
    assert p.recommended is Mode.DISAGGREGATED
    assert p.disaggregated_goodput > p.colocated_goodput


def test_deterministic_from_seed():
    wl = Workload(rate=3.0, prompt_mean=300, prompt_cv=1.0, output_mean=40, output_cv=0.5, image_fraction=0.5)
    args = (FLAT, wl, SLO(1.0, 0.05), 12)
    assert plan(*args, seed=7, requests_per_worker=200).to_dict() == plan(*args, seed=7,
                                                                          requests_per_worker=200).to_dict()


def test_hundreds_of_gpus_from_the_shipped_profile():
    prof = Profile.load(SHIPPED)
    assert prof.source.startswith("assumed")
    wl = Workload(rate=500, prompt_mean=2048, prompt_cv=1.0, output_mean=256, output_cv=0.5, image_fraction=0.3)
    p = plan(prof, wl, SLO(1.0, 0.05), 256, requests_per_worker=300)
    assert p.prefill + p.decode == 256 and p.prefill >= 1 and p.decode >= 1
    assert p.predicted["ttft_p90_s"] <= 1.0 and p.predicted["tpot_p90_s"] <= 0.05


@pytest.mark.parametrize("make, field", [
    (lambda: Profile(prefill_per_token_s=-1.0), "prefill_per_token_s"),
    (lambda: Profile(max_decode_batch=0), "max_decode_batch"),
    (lambda: Profile.from_dict({"prefill_per_tok": 1}), "unknown fields"),
    (lambda: Workload(image_fraction=1.5), "image_fraction"),
    (lambda: Workload(rate=-1), "rate"),
    (lambda: SLO(ttft_p90_s=0), "TTFT"),
    (lambda: plan(FLAT, Workload(), SLO(), 1), "gpus"),
], ids=["negative-cost", "batch", "unknown-field", "image-fraction", "rate", "slo", "gpus"])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(PlanError, match=field):
        make()


def test_cli_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(SHIPPED), "--gpus", "64", "--rate", "50", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "disaggregated" in text and "colocated" in text and "recommended:" in text
    got = json.loads(out.read_text())
    assert got["plan"]["prefill"] + got["plan"]["decode"] == 64
    assert got["plan"]["recommended"] in {"disaggregated", "colocated"}


def test_cli_bad_profile_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"decode_base_s": -1}))
    assert main(["plan", "--profile", str(bad)]) == 2
    assert "decode_base_s" in capsys.readouterr().err


def test_profile_fit_is_least_squares_clipped_at_zero():
    from cluster.cli.plan_cmd import fit_line

    assert fit_line(np.array([1, 2, 3]), np.array([0.012, 0.014, 0.016])) == pytest.approx((0.01, 0.002))
    assert fit_line(np.array([1, 2]), np.array([0.0, 1.0]))[0] == 0.0  # intercept -1 clipped


def test_profile_points_are_the_best_of_repeats():
    from cluster.cli.plan_cmd import best_of

    times = iter([0.030, 0.006, 0.007])  # the first run of a shape pays its allocations
    assert best_of(lambda: next(times)) == 0.006
    calls = []
    assert best_of(lambda: calls.append(1) or 0.5, repeats=0) == 0.5 and len(calls) == 1


def test_taking_a_request_in_delays_the_decode_batch():
    # 20 ms steps; B joins at 0.1 s while A decodes: with a 30 ms intake A's steps after it are 30 ms later
    req = _requests([0.0, 0.1], [100, 100], 11)
    free = simulate_decode_worker(FLAT, req.unit_arrivals, req.prompt, req.output)
    assert free.tolist() == pytest.approx([0.02, 0.02])
    slow = Profile(prefill_per_token_s=1e-3, decode_base_s=0.02, decode_join_base_s=0.01,
                   decode_join_per_token_s=2e-4)
    got = simulate_decode_worker(slow, req.unit_arrivals, req.prompt, req.output)
    assert got[0] == pytest.approx((10 * 0.02 + 2 * 0.03) / 10)  # its own intake and B's
    assert got[1] > 0.02


def test_the_vision_towers_cost_grows_with_the_image_tokens():
    """A per-visual-token cost: a request whose images hold 4x the tokens costs 4x the tower time; the workload's
    requests carry their image tokens so the simulators charge it; unknown image tokens (None) charge none."""
    prof = Profile(prefill_per_token_s=1e-3, prefill_per_visual_token_s=2e-3, decode_base_s=0.02)
    t = prof.prefill_s(np.array([100, 100]), np.array([1, 1]), np.array([64, 256]))
    np.testing.assert_allclose(t, [0.1 + 0.128, 0.1 + 0.512])
    np.testing.assert_allclose(prof.prefill_s(np.array([100]), np.array([1])), [0.1])
    req = Workload(prompt_mean=32, image_fraction=1.0, tokens_per_image=256).sample(4, seed=0)
    np.testing.assert_array_equal(req.visual, np.full(4, 256))
    idle = simulate_prefill_pool(prof, req.subset(np.arange(4), 1000.0), 1.0, 1)  # far apart: no queueing
    np.testing.assert_allclose(idle, (32 + 256) * 1e-3 + 256 * 2e-3)
