"""KV compression through the disaggregated path (prefill worker -> modal codec -> frames -> decode worker), in one
process: ``none`` gives exactly the local tokens; ``default`` / ``aggressive`` run and free everything; dropped
visual tokens get no attention at decode time (checked against transformers with those keys masked out);
approximate KV never enters the decode side's prefix cache; a bad header fails both sides and frees the blocks."""

from __future__ import annotations

import pytest
import torch

from cluster.control.local_pair import LocalPair
from decode_node.worker import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from engine.decode_mirror import DecodeKVMirror
from engine.kv_importance import KVImportance
from kv_transfer import KVPoll, ProtocolError
from kv_transfer.compression import codec_for, resolve_policy
from kv_transfer.inproc.manager import Manager as InprocManager
import prefill_node.worker as prefill_worker
from prefill_node.worker import PrefillWorker
from tests.conftest import (
    LLM_DEFAULTS,
    greedy,
    make_image,
    make_request,
    tokens_per_image,
)

CFG = dict(dtype="float32", num_kv_blocks=96, block_size=4, max_num_seqs=8, max_model_len=128)
DROP_HALF = {"name": "drop-half", "text": {"kind": "raw"}, "visual": {"kind": "raw"}, "keep_visual_tokens": 0.5}


def _prompts():
    return [make_request(6 + i, seed=i, images=[make_image(i)] * (1 + i % 3)) for i in range(4)]


def _local(model_dir, prompts, params):
    llm = LLM(model_dir, **{**LLM_DEFAULTS, **CFG})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _pair_tokens(model_dir, policy, prompts, params):
    pair = LocalPair(model_dir, EngineConfig(**CFG), compression=policy)
    try:
        outs, failed = pair.generate(prompts, params)
        assert not failed
        pair.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs], pair
    finally:
        pair.close()


def test_none_is_identical_to_local(tiny_model_dir):
    prompts, params = _prompts(), greedy(6)
    got, _ = _pair_tokens(tiny_model_dir, "none", prompts, params)
    assert got == _local(tiny_model_dir, prompts, params)


@pytest.mark.parametrize("policy", ["default", "aggressive", DROP_HALF], ids=["default", "aggressive", "drop"])
def test_lossy_policies_run_end_to_end_and_stay_out_of_the_prefix_cache(tiny_model_dir, policy):
    prompts, params = _prompts(), greedy(6)
    got, pair = _pair_tokens(tiny_model_dir, policy, prompts, params)
    assert [len(t) for t in got] == [6] * len(prompts)
    assert pair.decode.engine.block_manager.hash_to_block == {}  # approximate KV is never published
    assert pair.prefill.engine.block_manager.hash_to_block  # the prefill side's exact KV still is


def test_default_policy_keeps_text_exact_and_visual_close(tiny_model_dir):
    """What lands in the decode pool: the prefill's text KV bit for bit, its visual KV within int8 steps."""
    prompt = make_request(7, seed=3, images=[make_image(3)] * 2)
    pair = LocalPair(tiny_model_dir, EngineConfig(**CFG), compression="default")
    sent, received = {}, {}
    gather, write = pair.prefill.engine.runner.gather_layer, pair.decode.engine.write_layer

    def spy_gather(seq, layer):
        sent[layer] = gather(seq, layer)
        return sent[layer]

    def spy_write(request_id, layer, k, v, dropped=None):
        received[layer] = (k.clone(), v.clone())
        write(request_id, layer, k, v, dropped)

    pair.prefill.engine.runner.gather_layer = spy_gather
    pair.decode.engine.write_layer = spy_write
    try:
        _, failed = pair.generate([prompt], greedy(2))
        assert not failed
    finally:
        pair.close()
    ids = torch.tensor(prompt["prompt_token_ids"])
    visual = ids == 255
    assert int(visual.sum()) == 2 * tokens_per_image() and sorted(sent) == sorted(received) == [0, 1]
    for layer, (k, v) in sent.items():
        for ref, got in zip((k, v), received[layer], strict=True):
            ref, got = ref.flatten(0, 1)[: len(ids)], got.flatten(0, 1)[: len(ids)]
            assert torch.equal(ref[~visual], got[~visual])  # text: raw
            span = ref[visual].max() - ref[visual].min()
            assert 0 < (ref[visual] - got[visual]).abs().max() <= span / 255 * 0.51 + 1e-6  # visual: int8


def _fixed_token_scores(monkeypatch):
    """Every layer drops the same visual tokens: the later ones score lower."""
    def scores(q, k, v, *, scale, query_is_text=None):
        t, kvh, d = k.shape
        return KVImportance(torch.ones(kvh, d), torch.ones(kvh, d), -torch.arange(t, dtype=torch.float32))

    monkeypatch.setattr(prefill_worker, "kv_importance", scores)


def test_dropped_tokens_get_no_attention_like_a_masked_reference(tiny_model_dir, monkeypatch):
    """Decode logits with half the visual tokens dropped equal transformers' next-token logits when the same keys
    are masked out of the decode step (positions unchanged)."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    _fixed_token_scores(monkeypatch)
    images = [make_image(5), make_image(6)]
    prompt = make_request(6, seed=5, images=images)
    ids = prompt["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=3, return_logits=True)
    pair = LocalPair(tiny_model_dir, EngineConfig(**CFG), compression=DROP_HALF)
    try:
        (out,), failed = pair.generate([prompt], params)
        assert not failed
    finally:
        pair.close()
    visual = [i for i, t in enumerate(ids) if t == 255]
    keep = -(-len(visual) // 2)
    dropped = visual[keep:]
    assert dropped

    ref = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    pixels = AutoImageProcessor.from_pretrained(tiny_model_dir)(images, return_tensors="pt")["pixel_values"]
    n = len(ids)
    with torch.inference_mode():
        pre = ref(input_ids=torch.tensor([ids]), pixel_values=pixels, attention_mask=torch.ones(1, n, dtype=torch.long),
                  use_cache=True)
        assert pre.past_key_values is not None
        first = int(pre.logits[0, -1].argmax())
        mask = torch.ones(1, n + 1, dtype=torch.long)
        mask[0, dropped] = 0
        step = ref(input_ids=torch.tensor([[first]]), cache=pre.past_key_values, attention_mask=mask,
                   position_ids=torch.tensor([[n]]), cache_position=torch.tensor([n]), use_cache=True)
        full_mask = torch.ones(1, n + 1, dtype=torch.long)
        pre2 = ref(input_ids=torch.tensor([ids]), pixel_values=pixels, attention_mask=torch.ones(1, n, dtype=torch.long),
                   use_cache=True)
        unmasked = ref(input_ids=torch.tensor([[first]]), cache=pre2.past_key_values,
                       attention_mask=full_mask, position_ids=torch.tensor([[n]]), cache_position=torch.tensor([n]))
    assert out.outputs[0].token_ids[0] == first
    got = out.outputs[0].logits[0]
    torch.testing.assert_close(got, step.logits[0, -1].float(), rtol=1e-4, atol=1e-4)
    assert (got - unmasked.logits[0, -1].float()).abs().max() > 1e-3  # the mask mattered


def test_mirror_bias_follows_slots():
    m = DecodeKVMirror(num_layers=2, max_slots=4, kv_heads=1, head_dim=2, dtype=torch.float32,
                       device=torch.device("cpu"), initial_capacity=4, initial_slots=1)
    pool = [(torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)) for _ in range(2)]
    m.assign(1, 4, pool, [0], 5)
    m.assign(2, 4, pool, [1], 5, {0: torch.tensor([1, 2]), 1: torch.tensor([3])})
    m.assign(3, 3, pool, [2], 9)  # grows capacity and slots; bias rows survive
    mask = torch.zeros(3, 1, 1, 6)
    assert m.layer_masks([1, 3], torch.tensor([0, 2]), mask) is None  # no dropping sequence in this batch
    masks = m.layer_masks([1, 2, 3], torch.tensor([0, 1, 2]), mask)
    assert torch.isinf(masks[0][1, 0, 0, [1, 2]]).all() and torch.isfinite(masks[0][[0, 2]]).all()
    assert torch.isinf(masks[1][1, 0, 0, 3]) and torch.isfinite(masks[1][1, 0, 0, [0, 1, 2, 4, 5]]).all()
    m.release(1)  # seq 3 moves into slot 0, seq 2 stays in slot 1
    masks = m.layer_masks([2, 3], torch.tensor([1, 0]), torch.zeros(2, 1, 1, 6))
    assert torch.isinf(masks[0][0, 0, 0, [1, 2]]).all() and torch.isfinite(masks[0][1]).all()
    m.release(2)
    assert m.layer_masks([3], torch.tensor([0]), torch.zeros(1, 1, 1, 6)) is None
    m.assign(4, 2, pool, [3], 3)  # a new slot reusing a row that had drops starts clean
    assert torch.count_nonzero(m.bias[0][m.slot_of[4]]) == 0


def test_bad_header_fails_both_sides_and_frees_blocks(tiny_model_dir):
    pm, dm = InprocManager(), InprocManager()
    pw = PrefillWorker(tiny_model_dir, EngineConfig(**CFG), compression="default")
    dw = DecodeWorker(tiny_model_dir, EngineConfig(**CFG), dm, compression="default")
    prompt = make_request(6, seed=1, images=[make_image(1)])
    lease = dw.allocate("bad", prompt, greedy(3))
    sender = pm.sender(lease, codec=codec_for(resolve_policy("default")))

    def tamper(header, payload):
        header["codec_meta"]["v"] = 99

    sender.tamper = tamper
    pw.submit("bad", prompt, greedy(3), sender)
    failed = {}
    for _ in range(500):
        if not (pw.has_work() or dw.has_work()):
            break
        pw.step()
        failed.update(dw.step().failed)
        if dw.receivers:
            next(iter(dw.receivers.values())).wait(0.02)
    assert "bad" in failed and "version" in failed["bad"]
    assert sender.wait(5) == KVPoll.FAILED and isinstance(sender.failure_exception(), ProtocolError)
    for w in (pw, dw):
        w.engine.block_manager.check_no_leaks()
        assert not w.engine.requests
    pm.close()
    dm.close()


def test_more_transfers_than_max_num_seqs_wait_for_a_running_slot(tiny_model_dir):
    """Transfers that complete together beyond ``max_num_seqs`` queue (holding their blocks) instead of overflowing
    the decode batch; every request still finishes with the local tokens."""
    cfg = {**CFG, "max_num_seqs": 2}
    prompts = [make_request(5 + i, seed=30 + i) for i in range(5)]
    pair = LocalPair(tiny_model_dir, EngineConfig(**cfg))
    try:
        outs, failed = pair.generate(prompts, greedy(3))
        assert not failed
        pair.check_no_leaks()
    finally:
        pair.close()
    assert [o.outputs[0].token_ids for o in outs] == _local(tiny_model_dir, prompts, greedy(3))
