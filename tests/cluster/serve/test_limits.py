"""The pure parts of the front-end: image header checks, token budgets, retry hints, admission, stop strings, expert
load summaries, request timelines, and config validation — worked examples, no server."""

from __future__ import annotations

import io

import numpy as np
import pytest

from cluster.control.timeline import RequestClock
from cluster.demo import default_model_dir
from cluster.serve.config import ConfigError, build_configs, is_loopback
from cluster.serve.expert_load import ExpertLoad, placement_summary, summarize
from cluster.serve.limits import (
    Admission,
    Limits,
    Overloaded,
    check_image,
    resolve_max_tokens,
    retry_after_s,
)
from cluster.serve.stop_strings import StopMatcher
from engine.errors import ImageDecodeError, InvalidRequestError
from tests.conftest import make_image
from tests.cluster.serve.conftest import png_header_only


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    make_image(0, (h, w)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_checks_read_only_the_header():
    small = _png(10, 8)
    assert check_image(small, "image/png", Limits()) is small
    with pytest.raises(ImageDecodeError, match="image 2: 1000x1000 = 1000000 pixels is over the limit of 999999"):
        check_image(png_header_only(1000, 1000), "", Limits(max_image_pixels=999_999), index=2)
    with pytest.raises(ImageDecodeError, match="400000000 pixels is over the limit"):  # past PIL's own cap too
        check_image(png_header_only(20_000, 20_000), "", Limits())
    with pytest.raises(ImageDecodeError, match="bytes is over the limit of 100 bytes"):
        check_image(small, "", Limits(max_image_bytes=100))
    with pytest.raises(ImageDecodeError, match="not an image type"):
        check_image(small, "text/plain", Limits())
    with pytest.raises(ImageDecodeError, match="not a recognised image format"):
        check_image(b"GIF89a but not really", "", Limits())
    with pytest.raises(ImageDecodeError, match="no image data"):
        check_image(b"", "", Limits())


def test_limits_are_validated():
    with pytest.raises(InvalidRequestError, match="max_concurrent must be a positive integer"):
        Limits(max_concurrent=0)
    with pytest.raises(InvalidRequestError, match="max_tokens must be a positive integer or null"):
        Limits(max_tokens=-1)


@pytest.mark.parametrize("requested, expect", [
    (None, 24),  # the default 48 clipped to the 24 positions left
    (10, 10),
    (24, 24),
    (25, "does not fit the context: the prompt has 1000 tokens"),
    (0, "at least 1"),
    (2000, "over this server's limit of 1024"),
])
def test_resolve_max_tokens(requested, expect):
    if isinstance(expect, int):
        assert resolve_max_tokens(requested, 48, prompt_tokens=1000, max_model_len=1024, cap=1024) == expect
    else:
        with pytest.raises(InvalidRequestError, match=expect):
            resolve_max_tokens(requested, 48, prompt_tokens=1000, max_model_len=1024, cap=1024)


def test_retry_hint_is_the_gap_between_completions():
    assert retry_after_s([], now=5.0) == 1.0
    assert retry_after_s([10.0, 10.5, 11.0], now=11.0) == 0.5
    assert retry_after_s([10.0, 10.001], now=10.001) == 0.1  # floor
    assert retry_after_s([0.0, 100.0], now=100.0) == 30.0  # ceiling


def test_admission_refuses_at_the_cap_and_frees_on_leave():
    a = Admission(2)
    a.enter()
    a.enter()
    with pytest.raises(Overloaded, match="limit of 2 concurrent requests") as e:
        a.enter()
    assert e.value.retry_after_s == 1.0 and a.in_flight == 2
    a.leave()
    a.enter()
    assert a.in_flight == 2


def test_stop_strings_hold_back_only_a_possible_prefix():
    m = StopMatcher(["\n\n"])
    assert (m.push("red\n"), m.push("\nblue"), m.matched) == ("red", "", "\n\n")
    m = StopMatcher(["xyz"])
    assert (m.push("abx"), m.push("q"), m.push("xy"), m.flush()) == ("ab", "xq", "", "xy")
    m = StopMatcher(["end", "d"])
    assert (m.push("the end"), m.matched) == ("the ", "end")  # the match that starts first wins
    assert StopMatcher([]).push("anything") == "anything"


def test_expert_load_summary():
    assert summarize(np.array([[3, 1, 0, 0]])) == {"num_layers": 1, "num_experts": 4, "tokens_routed": 4,
                                                   "balancedness": [0.3333], "hottest_expert": [0]}
    load = ExpertLoad()
    load.add([[1, 1], [2, 0]])
    load.add([[1, 1], [0, 2]])
    s = load.summary()
    assert s["balancedness"] == [1.0, 1.0] and s["tokens_routed"] == 8
    assert "all experts" in placement_summary([{"experts": None}])
    assert "sharded across 2" in placement_summary([{"experts": {"slots": 4}}] * 2)


def test_request_timeline_worked_example():
    from cluster.control.delta import Delta, WorkerPair

    clock = RequestClock(arrival=10.0, preprocess_s=0.05)
    clock.observe(Delta("r", 0, []), now=10.1)
    clock.observe(Delta("r", 0, [7], placement=WorkerPair(10.2, "p0", "d0")), now=10.9)
    clock.observe(Delta("r", 0, [8], finished=True), now=11.5)
    t = clock.timeline({"exposed_seconds": 0.1}, attempts=1)
    breakdown = t.pop("ttft_breakdown")
    assert t == pytest.approx({"queue_s": 0.2, "preprocess_s": 0.05, "prefill_s": 0.6, "vision_encode_s": 0.0,
                               "decode_s": 0.6, "ttft_s": 0.9, "total_s": 1.5, "attempts": 1, "prefill_worker": "p0",
                               "decode_worker": "d0"})
    # no stages reported (and no admission times): what prefill did is in the rest
    assert breakdown["frontend_queue_s"] == pytest.approx(0.2) and breakdown["transfer_exposed_s"] == 0.1
    assert breakdown["first_token_streamed_s"] == pytest.approx(0.6)


def test_ttft_breakdown_worked_example():
    """The module docstring's example: the stages add up to the TTFT, in order."""
    from cluster.control.delta import Delta, WorkerPair
    from cluster.control.timeline import BREAKDOWN

    clock = RequestClock(arrival=10.0)
    pair = WorkerPair(10.2, "p0", "d0", admitted_at=10.05, allocated_at=10.07)
    clock.observe(Delta("r", 0, [7], placement=pair), now=10.9)
    clock.observe(Delta("r", 0, [8], finished=True), now=11.5)
    kv = {"exposed_seconds": 0.1, "commit_seconds": 0.05,
          "prefill_stages": {"prefill_queue_s": 0.1, "vision_encode_s": 0.2, "prefill_compute_s": 0.25}}
    t = clock.timeline(kv)
    assert list(t["ttft_breakdown"]) == list(BREAKDOWN)
    assert list(t["ttft_breakdown"].values()) == pytest.approx([0.05, 0.02, 0.13, 0.1, 0.2, 0.25, 0.1, 0.05, 0.0],
                                                               abs=1e-9)
    assert sum(t["ttft_breakdown"].values()) == pytest.approx(t["ttft_s"]) and t["vision_encode_s"] == 0.2
    # the submit reply overlapping the prefill stages: the overlap comes off the submit, the sum still adds up
    kv["prefill_stages"]["prefill_compute_s"] = 0.3
    b = clock.timeline(kv)["ttft_breakdown"]
    assert b["prefill_submit_s"] == pytest.approx(0.08) and sum(b.values()) == pytest.approx(0.9)
    # clocks that disagree beyond that (stages longer than the front-end saw) never give a negative stage
    kv["prefill_stages"]["prefill_compute_s"] = 5.0
    b = clock.timeline(kv)["ttft_breakdown"]
    assert b["first_token_streamed_s"] == 0.0 == b["prefill_submit_s"] and min(b.values()) >= 0


def test_config_overrides_and_loopback():
    spec, cfg = build_configs({"num_decode": 2, "serve": {"http_port": 9000, "limits": {"max_images": 2}}},
                              {"grpc_port": 0, "host": None}, str(default_model_dir()))
    assert (spec.num_decode, cfg.http_port, cfg.grpc_port, cfg.host, cfg.limits.max_images) == (2, 9000, 0,
                                                                                                 "127.0.0.1", 2)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    _, cfg = build_configs({}, {"host": "0.0.0.0", "token": "t"}, str(default_model_dir()))
    assert cfg.host == "0.0.0.0"
    _, cfg = build_configs({}, {"host": "0.0.0.0", "insecure": True}, str(default_model_dir()))
    with pytest.raises(ConfigError, match="without a token"):
        build_configs({}, {"host": "10.1.2.3"}, str(default_model_dir()))
