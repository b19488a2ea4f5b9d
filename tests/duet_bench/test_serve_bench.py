"""``duet bench serve``: the workload generator, the summaries and criteria (pure), and a ``--quick`` run."""

from __future__ import annotations

import itertools
import json

import pytest

from duet_bench.serve_bench import criteria
from duet_bench.serve_workload import make_workload, summarise
from cluster.cli.main import main


@pytest.fixture(scope="module")
def tok():
    from cluster.demo import default_model_dir
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_dir())


def _rec(ttft, tpot, tokens=4, done=1.0, error=None) -> dict:
    return {"kind": "text", "ttft_s": ttft, "tpot_s": tpot, "tokens": tokens, "done_s": done, "error": error}


def test_workload_is_seeded_and_rates_only_rescale_time(tok):
    a = make_workload(tok, 20, 2.0, seed=5, image_fraction=0.5, output_mean=8, output_max=16)
    b = make_workload(tok, 20, 4.0, seed=5, image_fraction=0.5, output_mean=8, output_max=16)
    assert [x.kind for x in a] == [x.kind for x in b] and [x.max_tokens for x in a] == [x.max_tokens for x in b]
    assert [x.at_s for x in a] == pytest.approx([2 * x.at_s for x in b])
    assert {x.kind for x in a} == {"text", "image"}
    assert all(1 <= x.max_tokens <= 16 for x in a)
    assert all(("multi_modal_data" in x.prompt) == (x.kind == "image") for x in a)
    assert all(x.at_s < y.at_s for x, y in itertools.pairwise(a))


def test_summary_counts_goodput_over_the_makespan():
    recs = [_rec(0.1, 0.01, done=1.0), _rec(2.0, 0.01, done=2.0), _rec(0.1, 0.5, done=3.0), _rec(0.2, None, 1, 4.0),
            _rec(None, None, 0, None, error="boom")]
    s = summarise(recs, ttft_slo=1.0, tpot_slo=0.1)
    assert (s["requests"], s["completed"], s["wall_s"]) == (5, 4, 4.0)
    assert s["goodput_req_s"] == pytest.approx(2 / 4.0)  # the first and the one-token request
    assert s["throughput_tok_s"] == pytest.approx((4 + 4 + 4 + 1) / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.15)


def _row(rate, c_p99, d_p99, c_good, d_good) -> dict:
    return {"rate": rate, "colocated": {"tpot_s": {"p99": c_p99}}, "disaggregated": {"tpot_s": {"p99": d_p99}},
            "ratios": {"p99_tpot": d_p99 / c_p99, "goodput": d_good / c_good}}


def test_criteria_only_at_rates_where_colocated_misses():
    rows = [_row(1, 0.05, 0.06, 2.0, 1.8), _row(4, 0.4, 0.1, 1.0, 2.0), _row(8, 0.8, 0.5, 1.0, 1.2)]
    c = criteria(rows, tpot_slo=0.1)
    assert [x["rate"] for x in c["checks"]] == [4, 8]
    assert [x["ok"] for x in c["checks"]] == [True, False]
    assert c["met"] is True and c["met_at"] == [4] and c["met_at_every_rate"] is False
    assert c["rates_colocated_wins"] == [1]
    assert criteria(rows[:1], tpot_slo=0.1)["met"] is None
    assert criteria(rows[2:], tpot_slo=0.1)["met"] is False


def test_bad_rates_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--rates", "1,-2"])
    assert e.value.code == 2


def test_quick_run_writes_the_figures(ray_cluster, tmp_path, capsys, monkeypatch):
    from duet_bench import serve_bench
    from cluster.control import disagg

    # every colocated request runs before the cluster exists (an idle cluster beside it slows the baseline)
    events: list[str] = []
    drive, cluster_init = serve_bench.drive_colocated, disagg.DisaggCluster.__init__

    def logged_drive(*a, **k):
        events.append("colocated")
        return drive(*a, **k)

    def logged_init(self, *a, **k):
        events.append("cluster")
        cluster_init(self, *a, **k)

    monkeypatch.setattr(serve_bench, "drive_colocated", logged_drive)
    monkeypatch.setattr(disagg.DisaggCluster, "__init__", logged_init)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--json", str(out)]) == 0
    assert events.count("cluster") == 1 and "colocated" not in events[events.index("cluster"):]
    assert events.count("colocated") >= 2  # the warm-up and the rate
    got = json.loads(out.read_text())
    assert got["quick"] and got["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    (row,) = got["rates"]
    assert row["rate"] == 4.0 and row["leaked_blocks"] == 0
    for name in ("colocated", "disaggregated"):
        s = row[name]
        assert s["requests"] == s["completed"] == 6, [r["error"] for r in s["records"]]
        assert set(s["ttft_s"]) == set(s["tpot_s"]) == {"p50", "p90", "p99"}
        assert s["goodput_req_s"] is not None and 0 <= s["slo_attainment"] <= 1
        assert all(r["tokens"] >= 1 for r in s["records"])
    assert {"p99_tpot", "goodput"} == set(row["ratios"])
    assert row["disaggregated"]["frontend_cpu_ms_per_request"] > 0  # the front-end process's CPU per request
    assert set(got["criteria"]) >= {"checks", "met", "rates_colocated_wins", "planner", "planner_met"}
    # the planner check: profiles of both systems, each rate's requests simulated, errors against the measurement
    assert set(got["profiles"]) == {"workers", "colocated"}
    assert all(p["decode_base_s"] + p["decode_per_seq_s"] > 0 and p["prefill_per_token_s"] > 0
               for p in got["profiles"].values())
    for name in ("colocated", "disaggregated"):
        assert row["predicted"][name]["ttft_s"]["p50"] > 0 and row["predicted"][name]["tpot_s"]["p50"] > 0
        assert row["prediction_errors"][f"{name}.ttft_s.p50"] == pytest.approx(
            row["predicted"][name]["ttft_s"]["p50"] / row[name]["ttft_s"]["p50"] - 1)
    (check,) = got["criteria"]["planner"]
    assert check["rate"] == 4.0 and check["max_abs_error"] >= 0
    out = capsys.readouterr().out
    assert "colocated" in out and "TTFT p50 pred" in out and "ms of CPU per request" in out
