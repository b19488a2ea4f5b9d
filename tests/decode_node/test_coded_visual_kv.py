"""A decode worker that keeps received image KV coded (``visual_kv_cache="int8"``, engine.coded_kv), end to end with
in-process prefill and decode workers: the image blocks live in pages lent from the pool (the mirror holds the plain
positions only), decoding stays close to the plain cache's, the compiled kernels and the torch fallback agree, n > 1
choices share the pages, and a prompt is admitted by the bytes it will be stored at (a typed refusal naming them,
nothing reserved, when it can never fit)."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.attention as attention
import engine.text_model as text_model
from decode_node.worker import DecodeWorker
from engine import EngineConfig, SamplingParams
from engine.errors import OutOfBlocksError, PromptTooLongError, RequestTooLargeError
from kv_transfer.inproc.manager import Manager as InprocManager
from prefill_node.worker import PrefillWorker
from tests.conftest import assert_no_leaked_blocks
from tests.engine.test_qwen_vl import build_prompt, image, request

CFG = dict(dtype="float32", num_kv_blocks=160, block_size=16, max_num_seqs=8, max_model_len=1024)
SIZES = [(256, 256), (256, 320), (320, 256)]  # 64, 80, 80 visual tokens


@pytest.fixture(scope="module")
def model_dir(tiny_qwen_ckpt) -> Path:
    return tiny_qwen_ckpt(max_pixels=512 * 512)


def prompts(model_dir: Path, sizes=SIZES) -> list[dict]:
    ims = [[image(i, s)] for i, s in enumerate(sizes)]
    return [request(build_prompt(im, model_dir, seed=i, text=5), im) for i, im in enumerate(ims)]


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1, n=n)


def serve(model_dir: Path, reqs: list[dict], p: SamplingParams, **decode) -> tuple[dict, dict, DecodeWorker]:
    """Every request through one prefill and one decode worker: (tokens, chosen logprobs) per (request, choice),
    and the decode worker; watches the pages while they decode."""
    pm = InprocManager()
    pw = PrefillWorker(model_dir, EngineConfig(**CFG))
    dw = DecodeWorker(model_dir, EngineConfig(**{**CFG, **decode}), InprocManager())
    for i, r in enumerate(reqs):
        pw.submit(f"r{i}", r, p, pm.sender(dw.allocate(f"r{i}", r, p)))
    tokens, lps, done = {}, {}, set()
    dw.most_pages, dw.mirror_filled = 0, {}  # seq id -> tokens its mirror slot was filled with
    assign = dw.engine.runner.mirror.assign

    def recording(seq_id, num_cached, *args, **kwargs):
        dw.mirror_filled[seq_id] = num_cached
        return assign(seq_id, num_cached, *args, **kwargs)

    dw.engine.runner.mirror.assign = recording
    for _ in range(3000):
        if len(done) == len(reqs) and not (pw.has_work() or dw.has_work()):
            break
        pw.step()
        report = dw.step()
        assert not report.failed
        dw.most_pages = max(dw.most_pages, dw.engine.block_manager.num_pages)
        for out in report.outputs:
            for c in out.outputs:
                tokens[out.request_id, c.index] = c.token_ids
                lps[out.request_id, c.index] = [lp.logprob for lp in c.logprobs]
            if out.finished:
                done.add(out.request_id)
        if not pw.has_work() and dw.receivers:
            next(iter(dw.receivers.values())).wait(0.05)
    assert len(done) == len(reqs)
    assert_no_leaked_blocks(pw.engine)
    assert_no_leaked_blocks(dw.engine)
    assert dw.engine.block_manager.num_pages == 0
    return tokens, lps, dw


def test_coded_image_kv_decodes_close_to_the_plain_cache(model_dir):
    reqs = prompts(model_dir)
    plain_tokens, plain_lp, plain = serve(model_dir, reqs, params())
    tokens, lp, coded = serve(model_dir, reqs, params(), visual_kv_cache="int8")
    assert plain.most_pages == 0 and coded.most_pages > 0
    # the mirror held the plain positions only: whole 16-token image blocks fewer per request
    held = [[filled[s] for s in sorted(filled)] for filled in (plain.mirror_filled, coded.mirror_filled)]
    assert len(held[0]) == len(held[1]) == len(reqs)
    assert all(a - b >= 3 * 16 and (a - b) % 16 == 0 for a, b in zip(*held, strict=True))
    same = [a == b for key in plain_tokens for a, b in zip(plain_tokens[key], tokens[key], strict=True)]
    assert sum(same) >= 0.8 * len(same)
    first = [abs(lp[key][0] - plain_lp[key][0]) for key in plain_lp]  # the first decode step reads the same tokens
    assert max(first) < 0.05


def test_kernels_and_torch_fallback_read_pages_alike(model_dir, monkeypatch):
    reqs = prompts(model_dir)[:2]
    tokens, lp, _ = serve(model_dir, reqs, params(), visual_kv_cache="int8")
    monkeypatch.setattr(attention, "_decode_kernel", lambda *a, **k: None)
    monkeypatch.setattr(text_model.DecoderLayer, "_decode_step", lambda *a, **k: None)
    fb_tokens, fb_lp, _ = serve(model_dir, reqs, params(), visual_kv_cache="int8")
    assert fb_tokens == tokens
    for key in lp:
        assert max(abs(a - b) for a, b in zip(lp[key], fb_lp[key], strict=True)) < 1e-3


def test_choices_share_the_pages(model_dir):
    tokens, _, dw = serve(model_dir, prompts(model_dir)[:1], params(n=3), visual_kv_cache="int8")
    assert sorted(tokens) == [("r0", 0), ("r0", 1), ("r0", 2)] and dw.most_pages > 0


def test_admission_by_the_bytes_it_will_be_stored_at(model_dir):
    big = prompts(model_dir, [(512, 512)])[0]  # 270 tokens, 256 of them image (8..263): 15 whole image blocks of 17
    for mode, blocks_in_pool, outcome in (("plain", 14, PromptTooLongError), ("int8", 14, None),
                                          ("int8", 7, RequestTooLargeError)):
        dw = DecodeWorker(model_dir, EngineConfig(**{**CFG, "num_kv_blocks": blocks_in_pool, "visual_kv_cache": mode}),
                          InprocManager())
        eng = dw.engine
        block_bytes = eng.runner.kv_bytes_per_token * 16
        if outcome is None:  # 2 plain blocks + 6 pages (240 tokens, 42 a page) of 14
            blocks = eng.preallocate("big", big, params())
            assert blocks.count(-1) == 15 and len(blocks) == 17 and eng.block_manager.num_pages == 6
            assert eng.kv_memory().visual_kv_bytes == 6 * block_bytes
            with pytest.raises(OutOfBlocksError):  # fits the pool, not what is free now
                eng.preallocate("again", big, params())
            assert eng.release_prefill("big")
        else:
            with pytest.raises(outcome, match="MiB") as err:
                eng.preallocate("big", big, params())
            if outcome is RequestTooLargeError:  # 2 plain blocks + 6 pages, 7 in the pool
                assert f"{8 * block_bytes:,} bytes of KV" in str(err.value)
                assert f"holds {7 * block_bytes:,} bytes" in str(err.value)
        assert not eng.requests and not eng.receiving and eng.block_manager.num_pages == 0
        assert_no_leaked_blocks(eng)


def test_aborts_while_receiving_and_while_decoding_give_the_pages_back(model_dir):
    reqs = prompts(model_dir)
    pm = InprocManager()
    pw = PrefillWorker(model_dir, EngineConfig(**CFG))
    dw = DecodeWorker(model_dir, EngineConfig(**{**CFG, "visual_kv_cache": "int8"}), InprocManager())
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, r in enumerate(reqs):
        pw.submit(f"r{i}", r, p, pm.sender(dw.allocate(f"r{i}", r, p)))
    bm = dw.engine.block_manager
    held = bm.num_pages
    assert held > 0
    assert dw.abort("r2") and pw.abort("r2", "aborted")  # still receiving: its pages go back at once
    assert bm.num_pages < held
    decoding = False
    for _ in range(3000):
        pw.step()
        report = dw.step()
        assert not report.failed
        if not decoding and any(o.request_id == "r0" and len(o.outputs[0].token_ids) >= 3 for o in report.outputs):
            assert dw.abort("r0")  # mid-decode
            decoding = True
        if decoding and not (pw.has_work() or dw.has_work()):
            break
        if not pw.has_work() and dw.receivers:
            next(iter(dw.receivers.values())).wait(0.05)
    assert decoding and not dw.engine.requests
    assert bm.num_pages == 0
    assert_no_leaked_blocks(dw.engine)
    assert_no_leaked_blocks(pw.engine)
