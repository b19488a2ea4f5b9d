"""The demo trainer's Muon: Newton-Schulz orthogonalization, which parameters it steps, the update split over
data-parallel workers, and a run with it."""

from __future__ import annotations

import pytest
import torch

from scripts.demo.muon import Muon, make_optimizers, orthogonalize, split_params
from scripts.demo.tokenizer import train_tokenizer
from scripts.demo.train import build_model, train


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_orthogonalize_flattens_the_spectrum_and_keeps_the_directions(shape):
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(*shape), full_matrices=False)
    g = u @ torch.diag(torch.logspace(-0.5, 0.5, min(shape))) @ vh  # singular values 0.32 .. 3.2
    o = orthogonalize(g)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic iteration's band around 1
    # same singular vectors: o is u diag(s') vh
    inner = u.mT @ o @ vh.mT
    torch.testing.assert_close(inner, torch.diag(torch.diagonal(inner)), atol=1e-4, rtol=0)


def test_a_stack_of_matrices_is_orthogonalized_one_by_one():
    torch.manual_seed(1)
    stack = torch.randn(3, 16, 8)
    got = orthogonalize(stack)
    for i in range(3):
        torch.testing.assert_close(got[i], orthogonalize(stack[i]), atol=1e-5, rtol=1e-5)


def test_split_params_on_the_demo_model():
    model = build_model(train_tokenizer(), seed=0)
    named = list(model.named_parameters())
    muon, adamw = split_params(named)
    assert len(muon) + len(adamw) == len(named)
    assert {id(p) for p in muon}.isdisjoint({id(p) for p in adamw})
    names = {id(p): n for n, p in named}
    muon_names = {names[id(p)] for p in muon}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in muon_names  # a stack of expert matrices
    assert "model.visual.blocks.0.attn.qkv.weight" in muon_names
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in muon_names
    for name in ("model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight",
                 "model.visual.pos_embed.weight", "model.language_model.layers.0.mlp.gate.weight",
                 "model.visual.merger.linear_fc1.weight", "model.visual.blocks.0.attn.qkv.bias"):
        assert name not in muon_names, name


def _step(params, grads, share=None):
    opt = Muon(params, lr=0.1, weight_decay=0.01, share=share)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()


def test_workers_share_the_orthogonalization_and_end_equal():
    """Each worker orthogonalizes every other matrix; the summed updates equal one worker doing all of them."""
    torch.manual_seed(2)
    init = [torch.randn(8, 12), torch.randn(2, 6, 4), torch.randn(10, 5)]
    grads = [torch.randn_like(t) for t in init]
    alone = [torch.nn.Parameter(t.clone()) for t in init]
    _step(alone, grads)
    sent: dict[int, torch.Tensor] = {}

    def reduce_for(rank):
        def reduce(flat):
            sent[rank] = flat.clone()
            if 1 - rank in sent:
                flat.add_(sent[1 - rank])
        return reduce

    workers = [[torch.nn.Parameter(t.clone()) for t in init] for _ in range(2)]
    _step(workers[1], grads, share=(1, 2, reduce_for(1)))  # records its half (its own result is not the sum)
    _step(workers[0], grads, share=(0, 2, reduce_for(0)))  # adds worker 1's half to its own
    assert not torch.equal(sent[0], sent[1])
    for a, b in zip(alone, workers[0], strict=True):
        torch.testing.assert_close(a, b)
    for p, t in zip(alone, init, strict=True):
        assert not torch.equal(p, t)


def test_update_size_follows_the_shape_and_weight_decay_applies():
    p = torch.nn.Parameter(torch.zeros(4, 16))
    _step([p], [torch.ones(4, 16)])
    # 0.2 * sqrt(16) * lr 0.1 = 0.08 per unit of the orthogonalized update
    o = orthogonalize(torch.ones(4, 16) * 1.95)  # Nesterov: grad + 0.95 * momentum (= grad)
    torch.testing.assert_close(p.detach(), -0.08 * o)
    q = torch.nn.Parameter(torch.ones(4, 16))
    opt = Muon([q], lr=0.1, weight_decay=0.5)
    q.grad = torch.zeros(4, 16)
    opt.step()
    torch.testing.assert_close(q.detach(), torch.full((4, 16), 0.95))  # decayed by lr x wd, no gradient step


def test_a_muon_run_is_deterministic_and_differs_from_adamw(tmp_path):
    kw = dict(steps=2, batch_size=2, progress=False, save=False)
    a, b = (train(tmp_path / n, optimizer="muon", **kw).state_dict() for n in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    adamw = train(tmp_path / "c", **kw).state_dict()
    assert any(not torch.equal(a[k], adamw[k]) for k in a)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizers(torch.nn.Linear(2, 2), [], "sgd", lr=0.1)
