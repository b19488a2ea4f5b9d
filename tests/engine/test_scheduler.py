"""The scheduler (``engine.scheduler``) alone, then the engine loop on tiny checkpoints: chunked prefill, prefix
caching, preemption, abort, stop conditions and sampling. Every engine scenario ends with no leaked KV block (the
``make_llm`` fixture checks at teardown; tests also check at the points that matter).
"""

from __future__ import annotations

import itertools

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from tests.conftest import assert_no_leaked_blocks, greedy, make_image, make_request

# ------------------------------------------------------------------------------------------ scheduler on its own
_ids = itertools.count()


def _seq(n: int, block_size: int = 4) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"s{i}", token_ids=list(range(100 + i, 100 + i + n)), num_prompt_tokens=n,
                    params=SamplingParams(), block_size=block_size)


def _advance(out: SchedulerOutput, bm: BlockManager) -> None:
    """What the engine does after running a step: count computed tokens, publish blocks, append sampled tokens."""
    for s in out.prefills + out.decodes:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_tokens
        bm.register_computed(s.seq)
        if samples:
            s.seq.token_ids.append(7)


def _plan(out: SchedulerOutput) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    return ([(s.seq.request_id, s.num_tokens) for s in out.prefills],
            [(s.seq.request_id, s.num_tokens) for s in out.decodes])


def test_budget_is_split_running_first_then_admissions():
    bm = BlockManager(16, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _seq(6), _seq(6)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert _plan(out) == ([(a.request_id, 6), (b.request_id, 2)], [])
    _advance(out, bm)
    out = sch.schedule()
    assert _plan(out) == ([(b.request_id, 4)], [(a.request_id, 1)])
    _advance(out, bm)
    assert _plan(sch.schedule()) == ([], [(a.request_id, 1), (b.request_id, 1)])


def test_one_token_chunk_mid_prompt_is_a_prefill_not_a_decode():
    # Regression: a 1-token chunk that does not reach the end of the prompt was listed as a decode, so the runner
    # returned a logit row for it and sampling failed (zip length mismatch).
    bm = BlockManager(16, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=7)
    a, b = _seq(6), _seq(5)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert _plan(out) == ([(a.request_id, 6), (b.request_id, 1)], [])
    assert [s.samples for s in out.prefills] == [True, False]


def test_max_num_seqs_caps_the_running_batch():
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [_seq(3) for _ in range(4)]
    for s in seqs:
        sch.add(s)
    out = sch.schedule()
    assert [s.seq for s in out.prefills] == seqs[:2] and list(sch.waiting) == seqs[2:]


def test_preemption_evicts_the_most_recent_and_requeues_it_first():
    bm = BlockManager(4, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = _seq(7), _seq(7), _seq(3)
    for s in (a, b, c):
        sch.add(s)
    out = sch.schedule()
    assert [s.seq for s in out.prefills] == [a, b]  # c does not fit
    _advance(out, bm)
    out = sch.schedule()  # a and b each write token 8: still within their 2 blocks
    assert [s.seq for s in out.decodes] == [a, b] and not out.preempted
    _advance(out, bm)
    out = sch.schedule()  # a's 9th token needs a third block: b (admitted last) makes room
    assert out.preempted == [b] and [s.seq for s in out.decodes] == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.metrics.num_preemptions == 1
    assert list(sch.waiting) == [b, c] and sch.running == [a]
    sch.finish(a, "length")
    sch.finish(b, "abort")
    sch.finish(c, "abort")
    bm.check_no_leaks()
    assert not sch.has_unfinished()


# --------------------------------------------------------------------------------------------- the engine loop
def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


MIXED = [  # text, one image, two images mid-prompt, a short prompt
    make_request(10, seed=0),
    make_request(7, seed=1, images=[make_image(1)]),
    make_request(9, seed=2, images=[make_image(2), make_image(3)], image_at=4),
    make_request(2, seed=3),
]
EDGES = [  # a prompt that is only <s>, and one that ends in image placeholders
    make_request(0, seed=4),
    make_request(3, seed=5, images=[make_image(5)], image_at=4),
]


@pytest.mark.parametrize("budget", [1, 5])
def test_chunked_prefill_matches_unchunked(make_llm, budget):
    prompts = MIXED + EDGES
    full = _tokens(make_llm().generate(prompts, greedy(10)))
    llm = make_llm(max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, greedy(10))) == full
    assert_no_leaked_blocks(llm)


def test_prefix_cache_hit_on_identical_prompt(make_llm):
    llm = make_llm()
    prompt = make_request(19, seed=4)  # 20 tokens: 4 full blocks may be reused, the last token always runs
    first = llm.generate(prompt, greedy(6))[0]
    second = llm.generate(prompt, greedy(6))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_prefix_cache_is_keyed_by_image_content(make_llm):
    # Tokens 0-8 text, 9-11 the image's placeholders (block 2 of size 4), 12-19 text.
    cat, dog = make_image(10), make_image(11)
    with_cat = make_request(16, seed=5, images=[cat], image_at=9)
    with_dog = make_request(16, seed=5, images=[dog], image_at=9)
    assert with_cat["prompt_token_ids"] == with_dog["prompt_token_ids"]
    llm = make_llm()
    first = llm.generate(with_cat, greedy(6))[0]
    same_image = llm.generate(make_request(16, seed=5, images=[make_image(10)], image_at=9), greedy(6))[0]
    other_image = llm.generate(with_dog, greedy(6))[0]
    assert first.num_cached_tokens == 0
    assert same_image.num_cached_tokens == 16 and same_image.outputs[0].token_ids == first.outputs[0].token_ids
    assert other_image.num_cached_tokens == 8  # no hit from the image's block on
    cold = make_llm(enable_prefix_caching=False).generate(with_dog, greedy(6))[0]
    assert cold.num_cached_tokens == 0
    assert other_image.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_prefix_hit_ending_inside_an_image(make_llm):
    # Tokens 0-6 text, 7-9 the image (straddling blocks 1 and 2), 10-16 text. The second prompt differs at token 10,
    # so its hit (blocks 0-1) ends after the image's first placeholder and prefill resumes mid-image.
    image = make_image(20)
    first = make_request(14, seed=21, images=[image], image_at=7)
    second = make_request(14, seed=21, images=[make_image(20)], image_at=7)
    second["prompt_token_ids"][10] = (second["prompt_token_ids"][10] + 1) % 200
    llm = make_llm()
    llm.generate(first, greedy(4))
    hit = llm.generate(second, greedy(6))[0]
    assert hit.num_cached_tokens == 8
    cold = make_llm(enable_prefix_caching=False).generate(second, greedy(6))[0]
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_prefix_hit_covers_generated_tokens(make_llm):
    # A follow-up turn whose prompt is the previous prompt plus its answer reuses the answer's KV too.
    llm = make_llm()
    turn1 = make_request(9, seed=22, images=[make_image(22)], image_at=3)
    answer = llm.generate(turn1, greedy(12))[0].outputs[0].token_ids
    turn2 = {**turn1, "prompt_token_ids": turn1["prompt_token_ids"] + answer + [5, 6, 7]}
    hit = llm.generate(turn2, greedy(6))[0]
    assert hit.num_cached_tokens == 24  # KV of 13 prompt + 11 answer tokens (the last one never ran): 6 blocks
    cold = make_llm(enable_prefix_caching=False).generate(turn2, greedy(6))[0]
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize(("prefix_caching", "budget"), [(True, 4096), (False, 4096), (True, 5)],
                         ids=["prefix-cache", "no-prefix-cache", "prefix-cache-chunked"])
def test_preemption_gives_the_same_outputs(make_llm, prefix_caching, budget):
    params = [greedy(16), greedy(16), SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True),
              greedy(16)]
    big = _tokens(make_llm(enable_prefix_caching=prefix_caching).generate(MIXED, params))
    llm = make_llm(num_kv_blocks=8, enable_prefix_caching=prefix_caching,  # 32 slots for ~100 tokens of work
                   max_num_batched_tokens=budget)
    assert llm.engine.max_model_len == 32  # still fits the longest request (16 prompt + 16 generated)
    outs = llm.generate(MIXED, params)
    assert _tokens(outs) == big
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert_no_leaked_blocks(llm)


def _run_until(engine, cond, limit: int = 100) -> list:
    outs = []
    for _ in range(limit):
        if cond():
            return outs
        outs += engine.step()
    raise AssertionError("condition never reached")


def test_abort_waiting_and_running_requests(make_llm):
    llm = make_llm(max_num_seqs=1, max_num_batched_tokens=4)
    engine = llm.engine
    engine.add_request("long", make_request(20, seed=6), greedy(8))
    engine.add_request("next", make_request(5, seed=7, images=[make_image(7)]), greedy(8))
    engine.step()  # "long" is mid-prefill (4 of 21 tokens), "next" waits
    (running,) = engine.scheduler.running
    assert running.request_id == "long" and 0 < running.num_computed_tokens < running.num_prompt_tokens
    assert [s.request_id for s in engine.scheduler.waiting] == ["next"]
    assert engine.abort_request("next")
    assert engine.abort_request("long")
    assert running.finish_reason == "abort" and running.block_table == []
    assert_no_leaked_blocks(engine)
    assert not engine.abort_request("long")  # already gone
    assert not engine.abort_request("never-added")
    assert engine.step() == []
    assert_no_leaked_blocks(engine)


def test_abort_while_decoding_then_keep_serving(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", make_request(6, seed=8), greedy(50))
    engine.add_request("b", make_request(6, seed=9), greedy(3))
    outs = _run_until(engine, lambda: "b" not in engine.requests)
    assert [o.finished for o in outs if o.request_id == "b"] == [False, False, True]
    assert "a" in engine.requests and engine.requests["a"].num_output_tokens == 3
    assert engine.abort_request("a")
    assert_no_leaked_blocks(engine)
    solo = make_llm().generate(make_request(6, seed=9), greedy(3))[0]
    assert llm.generate(make_request(6, seed=9), greedy(3))[0].outputs[0].token_ids == solo.outputs[0].token_ids


def test_step_streams_one_token_per_request_per_step(make_llm):
    engine = make_llm().engine
    engine.add_request("x", make_request(5, seed=10), greedy(4))
    counts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts.append((len(out.outputs[0].token_ids), out.finished, out.outputs[0].finish_reason))
    assert counts == [(1, False, None), (2, False, None), (3, False, None), (4, True, "length")]


# ------------------------------------------------------------------------------------------------------- stops
STOP_PROMPT = make_request(9, seed=11)


@pytest.fixture
def reference(make_llm) -> list[int]:
    """Greedy tokens of STOP_PROMPT, and the token at index 2 that stop tests stop on."""
    ref = make_llm().generate(STOP_PROMPT, greedy(12))[0].outputs[0].token_ids
    assert 254 not in ref  # the checkpoint's EOS would end the non-ignore_eos runs early
    return ref


def test_stop_token_ids(make_llm, reference):
    stop = reference[2]
    first = reference.index(stop)
    out = make_llm().generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
    c = out.outputs[0]
    assert c.token_ids == reference[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop


def test_eos_stops_unless_ignored(make_llm, reference):
    eos = reference[2]
    first = reference.index(eos)
    llm = make_llm()
    llm.engine.eos_token_ids = [eos]  # pretend the model's EOS is a token greedy is known to produce
    c = llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert c.token_ids == reference[: first + 1] and c.finish_reason == "stop" and c.stop_reason is None
    c = llm.generate(STOP_PROMPT, greedy(12))[0].outputs[0]  # ignore_eos
    assert c.token_ids == reference and c.finish_reason == "length"


@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_min_tokens_suppresses_stops(make_llm, reference, via):
    stop = reference[2]
    first = reference.index(stop)
    llm = make_llm()
    kwargs = {"stop_token_ids": [stop]} if via == "stop_token_ids" else {}
    if via == "eos":
        llm.engine.eos_token_ids = [stop]
    min_tokens = first + 3
    c = llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens, **kwargs))[0]
    c = c.outputs[0]
    assert c.token_ids[:first] == reference[:first]
    assert stop not in c.token_ids[:min_tokens]
    assert len(c.token_ids) > min_tokens or c.finish_reason == "length"
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == stop and stop not in c.token_ids[:-1]
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == 12 and stop not in c.token_ids


def test_max_tokens(make_llm, reference):
    c = make_llm().generate(STOP_PROMPT, greedy(5))[0].outputs[0]
    assert c.token_ids == reference[:5] and c.finish_reason == "length"
    c = make_llm().generate(STOP_PROMPT, greedy(1))[0].outputs[0]
    assert c.token_ids == reference[:1] and c.finish_reason == "length"


def test_max_model_len_ends_with_length(make_llm, reference):
    llm = make_llm(max_model_len=16)
    assert len(STOP_PROMPT["prompt_token_ids"]) == 10
    c = llm.generate(STOP_PROMPT, greedy(100))[0].outputs[0]
    assert c.token_ids == reference[:6] and c.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- sampling
def _sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 12, "ignore_eos": True, **kw})


def test_seed_reproducible_across_batch_compositions(make_llm):
    target = make_request(6, seed=12, images=[make_image(12)])
    alone = _tokens(make_llm().generate(target, _sampled(7)))[0]
    others = [make_request(12, seed=13), make_request(3, seed=14), make_request(8, seed=15)]
    llm = make_llm(max_num_batched_tokens=5)
    outs = llm.generate([others[0], target, others[1], others[2]],
                        [_sampled(1), _sampled(7), SamplingParams(temperature=1.2, max_tokens=9), greedy(4)])
    assert outs[1].outputs[0].token_ids == alone
    again = _tokens(make_llm(max_num_seqs=2).generate([others[2], target], [greedy(20), _sampled(7)]))[1]
    assert again == alone


def test_different_seeds_give_different_samples(make_llm):
    llm = make_llm()
    outs = _tokens(llm.generate([make_request(6, seed=16)] * 4, [_sampled(s) for s in range(4)]))
    assert len({tuple(t) for t in outs}) > 1


def test_top_k_1_and_tiny_top_p_are_greedy(make_llm):
    llm = make_llm()
    prompt = make_request(6, seed=17)
    want = _tokens(llm.generate(prompt, greedy(12)))[0]
    assert _tokens(llm.generate(prompt, _sampled(5, top_k=1, temperature=1.5)))[0] == want
    assert _tokens(llm.generate(prompt, _sampled(6, top_p=1e-6)))[0] == want


def test_generate_with_a_list_of_sampling_params(make_llm):
    llm = make_llm()
    prompts = [make_request(5, seed=18), make_request(9, seed=19, images=[make_image(19)]), make_request(4, seed=20)]
    want = _tokens(llm.generate(prompts, greedy(8)))
    outs = llm.generate(prompts, [greedy(3), greedy(8), _sampled(2, max_tokens=5)])
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=lambda r: int(r.split("-")[1]))
    got = _tokens(outs)
    assert got[0] == want[0][:3] and got[1] == want[1] and len(got[2]) == 5
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        llm.generate(prompts, [greedy(3), greedy(3)])
    assert_no_leaked_blocks(llm)


def test_an_image_repeated_in_a_prompt_is_encoded_once(make_llm, monkeypatch):
    """Images are encoded once per distinct content, within a prompt as across prompts: a prompt showing one image
    twice (and another once) encodes two images, and decodes exactly as when one of them came from the cache."""
    cat, dog = make_image(12), make_image(13)
    prompt = make_request(6, seed=7, images=[cat, cat.copy(), dog])

    def run(warm_with=None):
        llm, encoded = make_llm(enable_prefix_caching=False), []
        inner = llm.engine.runner.model.encode_images
        monkeypatch.setattr(llm.engine.runner.model, "encode_images", lambda px: encoded.append(len(px)) or inner(px))
        if warm_with is not None:
            llm.generate(warm_with, greedy(1))
        return llm.generate(prompt, greedy(6))[0].outputs[0].token_ids, encoded

    fresh, encoded = run()
    assert encoded == [2]
    warm, encoded = run(warm_with=make_request(4, seed=8, images=[cat]))
    assert encoded == [1, 1] and warm == fresh
