"""duet bench structured, in its smallest form: every mode measured, the grammar open for every constrained token."""

from __future__ import annotations

import argparse
import json

from duet_bench.structured_bench import MODES, add_arguments, run


def test_structured_bench_reports_every_mode(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--batch", "2", "--tokens", "6", "--rounds", "2", "--vocab", "0",
                         "--json", str(tmp_path / "s.json")])
    assert run(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    model = result["models"]["model"]
    assert set(model["end_to_end"]) == set(MODES)
    assert model["end_to_end"]["json_schema"]["grammar_open_fraction"] == 1.0  # at least 60 objects: never done
    assert model["mask"]["doc_tokens"] == 256 and model["mask"]["mask_us_per_row"] > 0
    assert all(len(e["rounds_s"]) == 2 for e in model["end_to_end"].values())
    assert "mask only" in capsys.readouterr().out
