"""Sampling inputs the serving fuzz tests found failing inside a worker step (which aborts every request of the
batch): each must either sample or be refused as a typed error when the params are built."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.sampler import greedy_ids, sample, suppress_stop_tokens


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token(top_p):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    res = sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)], [torch.Generator().manual_seed(0)])
    assert res.tokens == [1]


def test_stop_ids_outside_the_vocabulary_are_not_suppressed_and_do_not_fail():
    logits = torch.zeros(2, 4)
    suppress_stop_tokens(logits, [0, 1], [[3, 4, 10**6], [2**62]])
    assert logits[0].tolist() == [0.0, 0.0, 0.0, float("-inf")] and logits[1].tolist() == [0.0] * 4


@pytest.mark.parametrize("bad", [dict(seed=2**64), dict(seed=-(2**63) - 1), dict(top_k=2**63),
                                 dict(min_tokens=2**70, max_tokens=None), dict(stop_token_ids=[-1]),
                                 dict(stop_token_ids=[2**63])])
def test_integers_the_wire_cannot_carry_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_64_bit_seeds_are_taken():
    for seed in (-(2**63), 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_equal_torch_argmax_on_ties_nan_and_inf(dtype):
    """The batched greedy pick (numpy's argmax for float32 on CPU, torch's otherwise) is torch.argmax's: the first
    largest index, a NaN counted as largest, also on a strided view."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g)
    x[1, 3] = float("nan")
    x[2, [7, 9]] = float("nan")
    x[3, :] = 1.0
    x[4, [5, 8]] = float("inf")
    x[5, [10, 200]] = x[5].max() + 1
    x = x.to(dtype)
    assert greedy_ids(x) == torch.argmax(x, dim=-1).tolist()
    assert greedy_ids(x)[1:6] == [3, 7, 0, 5, 10]
    view = x[:, ::2]
    assert greedy_ids(view) == torch.argmax(view, dim=-1).tolist()
