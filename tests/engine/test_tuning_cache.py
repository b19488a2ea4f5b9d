"""The host's kernel-choice cache (engine.tuning_cache): a measurement is taken once and read back by the next
process, entries expire, the file is merged and replaced whole, a bad file or ``off`` never fails a load; and a
model load writes its choices and a second load (a fresh process's tables) reads them instead of probing."""

from __future__ import annotations

import json
import time

import pytest
import torch

import engine.tuning_cache as tc
from engine import cpu_linear, moe, text_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache in a temporary directory, with this process's view of it emptied before and after."""
    monkeypatch.setenv(tc.ENV, str(tmp_path))
    monkeypatch.setattr(tc, "_entries", None)
    monkeypatch.setattr(tc, "_new", {})
    return tmp_path


def _new_process(monkeypatch) -> None:
    """What a process that has not read the file nor measured anything holds."""
    monkeypatch.setattr(tc, "_entries", None)
    monkeypatch.setattr(tc, "_new", {})


def test_a_measurement_is_read_back_by_the_next_process(cache_dir, monkeypatch):
    calls = []
    value = ((0.5, 1.5), (True, 3))
    table: dict = {}
    got = tc.remembered(table, "t", (4, torch.float32, 2), lambda: calls.append(1) or value, like=value)
    assert got == value and table == {(4, torch.float32, 2): value} and calls == [1]
    assert tc.remembered(table, "t", (4, torch.float32, 2), lambda: calls.append(1), like=value) == value
    assert calls == [1]
    assert tc.save() and tc.cache_path().is_file() and not tc.save()  # nothing new: not written again

    _new_process(monkeypatch)
    fresh: dict = {}
    got = tc.remembered(fresh, "t", (4, torch.float32, 2), lambda: pytest.fail("measured again"), like=value)
    assert got == value and isinstance(got, tuple) and isinstance(got[0], tuple)  # JSON lists back into tuples
    assert tc.remembered({}, "t", (5, torch.float32, 2), lambda: 7, like=0) == 7  # another key is measured
    _new_process(monkeypatch)  # an answer of another shape (a changed probe) is measured again
    assert tc.remembered({}, "t", (4, torch.float32, 2), lambda: ((1.0, 2.0),), like=((0.0, 0.0),)) == ((1.0, 2.0),)


def test_an_old_entry_is_measured_again(cache_dir, monkeypatch):
    tc.remembered({}, "t", (1,), lambda: 1, like=0)
    tc.save()
    _new_process(monkeypatch)
    real = time.time
    monkeypatch.setattr(tc.time, "time", lambda: real() + tc.MAX_AGE_S + 1)
    assert tc.remembered({}, "t", (1,), lambda: 2, like=0) == 2


def test_save_merges_what_another_process_wrote_meanwhile(cache_dir, monkeypatch):
    tc.remembered({}, "a", (1,), lambda: 10, like=0)  # this process measured "a" (the file was empty when it read it)
    mine = tc._new
    _new_process(monkeypatch)
    tc.remembered({}, "b", (2,), lambda: 20, like=0)  # another process measured "b" and saved first
    assert tc.save()
    monkeypatch.setattr(tc, "_new", mine)
    assert tc.save()
    doc = json.loads(tc.cache_path().read_text())
    assert doc["version"] == tc.CACHE_VERSION and set(doc["tables"]) == {"a", "b"}
    assert [p.name for p in cache_dir.iterdir()] == [tc.cache_path().name]  # no temporary file left


def test_a_bad_file_counts_as_empty_and_off_keeps_nothing(cache_dir, monkeypatch):
    path = tc.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for text in ("{not json", json.dumps({"version": tc.CACHE_VERSION + 1, "tables": {"t": {"(1,)": [5, now]}}}),
                 json.dumps({"version": tc.CACHE_VERSION, "tables": {"t": {"(1,)": "garbage"}}}),
                 json.dumps({"version": tc.CACHE_VERSION, "tables": {"t": {"(1,)": ["5", now]}}}),
                 json.dumps({"version": tc.CACHE_VERSION, "tables": {"t": {"(1,)": [True, now]}}})):
        path.write_text(text)
        _new_process(monkeypatch)
        assert tc.remembered({}, "t", (1,), lambda: 6, like=0) == 6
    assert tc.save() and json.loads(path.read_text())["tables"]["t"]["(1,)"][0] == 6

    monkeypatch.setenv(tc.ENV, "off")
    _new_process(monkeypatch)
    assert tc.cache_path() is None
    assert tc.remembered({}, "t", (1,), lambda: 8, like=0) == 8 and not tc.save()


def test_a_model_load_writes_its_choices_and_the_next_load_probes_nothing(cache_dir, monkeypatch, tiny_model_dir):
    from engine import LLM

    saved = [dict(t) for t in (cpu_linear._timings, cpu_linear._few_row_timings, moe._PATHS, text_model._ONE_CALL)]
    try:
        for t in (cpu_linear._timings, cpu_linear._few_row_timings, moe._PATHS, text_model._ONE_CALL):
            t.clear()
        first = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=64)
        doc = json.loads(tc.cache_path().read_text())
        assert {"linear", "one_call"} <= set(doc["tables"])
        choices = first.engine.runner.model.linear_kernels
        _new_process(monkeypatch)
        for t in (cpu_linear._timings, cpu_linear._few_row_timings, moe._PATHS, text_model._ONE_CALL):
            t.clear()
        monkeypatch.setattr(cpu_linear, "_measure_timings", lambda *a: pytest.fail("linear probed again"))
        monkeypatch.setattr(text_model, "_probe_one_call", lambda *a: pytest.fail("one-call probed again"))
        second = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=64)
        assert second.engine.runner.model.linear_kernels == choices
    finally:
        for t, old in zip((cpu_linear._timings, cpu_linear._few_row_timings, moe._PATHS, text_model._ONE_CALL),
                          saved, strict=True):
            t.clear()
            t.update(old)
