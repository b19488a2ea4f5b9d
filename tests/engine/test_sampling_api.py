"""Logprobs, n > 1 choices over shared prompt blocks, penalties and per-choice seeds (engine level, tiny model).

Logprobs are checked against ``log_softmax`` of the logits the engine returns (``return_logits``) and, for greedy
requests, against transformers' ``output_scores``; choices against ``n=1`` runs (greedy choices must all equal the
single greedy answer, which only holds if the shared and copied prompt KV is right).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from duet_testing.checkpoints import load_reference_model
from engine.errors import InvalidRequestError
from engine.penalties import apply_penalties
from engine.sampler import processed_logits
from engine.sequence import Sequence
from tests.conftest import assert_no_leaked_blocks, greedy, make_request

TOL = 1e-5


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from tests.conftest import LLM_DEFAULTS

    engine = LLM(tiny_model_dir, **LLM_DEFAULTS)
    yield engine
    assert_no_leaked_blocks(engine)


def _check_logprobs(completion, params: SamplingParams) -> None:
    assert len(completion.logprobs) == len(completion.token_ids) == len(completion.logits)
    for tok, lp, logits in zip(completion.token_ids, completion.logprobs, completion.logits, strict=True):
        want = torch.log_softmax(processed_logits(logits, params).float(), dim=-1)
        assert lp.token_id == tok
        assert abs(lp.logprob - float(want[tok])) <= TOL
        assert len(lp.top) == params.logprobs
        top_ids = torch.topk(want, params.logprobs).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        for t, x in lp.top:
            assert abs(x - float(want[t])) <= TOL


@pytest.mark.parametrize("params", [
    greedy(6, logprobs=3, return_logits=True),
    SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=6, ignore_eos=True, seed=3, logprobs=2,
                   return_logits=True),
    greedy(6, logprobs=1, return_logits=True, frequency_penalty=1.0, repetition_penalty=1.3),
], ids=["greedy", "sampled-topk-topp", "greedy-penalised"])
def test_logprobs_are_log_softmax_of_the_sampled_distribution(llm, params):
    out = llm.generate(make_request(9, seed=1), params)[0]
    _check_logprobs(out.outputs[0], params)


def test_greedy_logprobs_match_transformers_scores(llm, tiny_model_dir):
    ids = make_request(10, seed=2)["prompt_token_ids"]
    ref = load_reference_model(tiny_model_dir)
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        g = ref.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = llm.generate({"prompt_token_ids": ids}, greedy(5, logprobs=0))[0].outputs[0]
    assert out.token_ids == g.sequences[0, len(ids):].tolist()
    for lp, scores in zip(out.logprobs, g.scores, strict=True):
        want = torch.log_softmax(scores[0].float(), dim=-1)
        assert abs(lp.logprob - float(want[lp.token_id])) <= 1e-4  # two implementations: a float tolerance


def test_prompt_logprobs_match_transformers_forward(tiny_model_dir):
    """Chunked prefill (budget 4 tokens a step) and a cached prefix must not matter: every prompt position is
    computed and scored once."""
    from tests.conftest import LLM_DEFAULTS

    ids = make_request(10, seed=8)["prompt_token_ids"]
    ref = load_reference_model(tiny_model_dir)
    with torch.inference_mode():
        want = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    llm = LLM(tiny_model_dir, **{**LLM_DEFAULTS, "max_num_batched_tokens": 4})
    llm.generate({"prompt_token_ids": ids}, greedy(2))  # its blocks are cached now: a hit would skip positions
    out = llm.generate({"prompt_token_ids": ids}, greedy(2, prompt_logprobs=2))[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for p, lp in enumerate(out.prompt_logprobs[1:]):
        assert lp.token_id == ids[p + 1]
        assert abs(lp.logprob - float(want[p, ids[p + 1]])) <= 1e-4
        assert [t for t, _ in lp.top] == torch.topk(want[p], 2).indices.tolist()
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("prompt_tokens", [9, 11], ids=["partial-last-block", "full-blocks"])
def test_greedy_choices_share_the_prompt_and_all_equal_n1(llm, prompt_tokens):
    """block_size 4: a 10-token prompt copies its partial last block per choice, a 12-token one shares them all."""
    prompt = make_request(prompt_tokens, seed=4)
    one = llm.generate(prompt, greedy(7))[0].outputs[0].token_ids
    out = llm.generate(prompt, greedy(7, n=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == one for c in out.outputs)
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert_no_leaked_blocks(llm)


def test_choices_without_a_free_block_recompute_and_still_agree(tiny_model_dir):
    """A pool of 4 blocks: the 10-token prompt takes 3, one choice gets the one free block for its copy, the other
    waits, recomputes (preempting as needed) and still gives the greedy answer."""
    tight = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=4, block_size=4, max_num_seqs=4, max_model_len=16)
    prompt = make_request(9, seed=4)
    one = tight.generate(prompt, greedy(4))[0].outputs[0].token_ids
    out = tight.generate(prompt, greedy(4, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [one] * 3
    assert_no_leaked_blocks(tight)


def test_seeded_choices_are_deterministic_and_distinct(llm):
    prompt = make_request(9, seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11, n=4)
    a = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompt, make_request(5, seed=6)], [params, greedy(3)])[0].outputs]
    assert a == b  # same seed, different batch-mates: the same four choices
    assert len({tuple(t) for t in a}) == 4
    single = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11))[0]
    assert single.outputs[0].token_ids == a[0]  # choice 0 samples from the request's own seed


def test_abort_frees_every_choice(llm):
    engine = llm.engine
    engine.add_request("many", make_request(9, seed=7), greedy(50, n=4))
    for _ in range(3):
        engine.step()
    assert len(engine.requests["many"].group) == 4
    assert engine.abort_request("many")
    assert_no_leaked_blocks(llm)


def test_penalties_worked_example():
    seq = Sequence(0, "r", [1, 0, 0], num_prompt_tokens=1, block_size=4,
                   params=SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0))
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    apply_penalties(logits, [seq])
    torch.testing.assert_close(logits, torch.tensor([[-0.25, -2.0, 0.5]]))
    seq.token_ids.append(2)  # counts follow the output incrementally
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    apply_penalties(logits, [seq])
    torch.testing.assert_close(logits, torch.tensor([[-0.25, -2.0, 0.25 - 0.5 - 0.25]]))


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(frequency_penalty=-2.5), dict(repetition_penalty=0),
                                 dict(logprobs=21), dict(logprobs=-1), dict(n=0), dict(n=17)])
def test_bad_sampling_params_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
