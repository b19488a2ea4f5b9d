"""The demo trainer's bfloat16 autocast (attention in float32) and its moving average of the weights."""

from __future__ import annotations

import pytest
import torch

from scripts.demo.speed import WeightAverage, resolve_precision, use_fp32_attention
from scripts.demo.tokenizer import train_tokenizer
from scripts.demo.train import build_model, train


def test_weight_average_warms_up_then_decays_and_swaps_back():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    avg = WeightAverage(model, decay=0.9)
    with torch.no_grad():
        model.weight.fill_(3.0)
    avg.update(0)  # decay min(0.9, 1/10): 0.1 * 1 + 0.9 * 3
    assert torch.allclose(avg.averaged[0], torch.full((1, 2), 2.8))
    avg.update(100)  # decay 0.9: 0.9 * 2.8 + 0.1 * 3
    assert torch.allclose(avg.averaged[0], torch.full((1, 2), 2.82))
    with avg.applied():
        assert torch.allclose(model.weight, torch.full((1, 2), 2.82))
    assert torch.equal(model.weight, torch.full((1, 2), 3.0))
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(model, decay=1.0)


def test_a_run_with_averaging_saves_the_average(tmp_path):
    """One step with a decay warmed up to 0.1: the weights returned are 0.1 x the initial + 0.9 x the stepped ones
    (the same run without averaging)."""
    init = build_model(train_tokenizer(), seed=0).state_dict()
    plain = train(tmp_path / "a", steps=1, batch_size=2, progress=False, save=False).state_dict()
    averaged = train(tmp_path / "b", steps=1, batch_size=2, progress=False, save=False, ema=0.99).state_dict()
    moved = [k for k in init if not torch.equal(init[k], plain[k])]
    assert moved  # the step changed the weights
    for k in moved:
        torch.testing.assert_close(averaged[k], 0.1 * init[k] + 0.9 * plain[k], rtol=1e-5, atol=1e-6)


def test_bfloat16_training_is_deterministic_and_returns_a_plain_model(tmp_path):
    runs = [train(tmp_path / n, steps=2, batch_size=2, progress=False, save=False, precision="bfloat16")
            for n in ("a", "b")]
    a, b = (r.state_dict() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())  # float32 master weights
    f32 = train(tmp_path / "c", steps=2, batch_size=2, progress=False, save=False).state_dict()
    assert any(not torch.equal(a[k], f32[k]) for k in a)  # the autocast took part
    assert runs[0].config._attn_implementation == "sdpa"  # saved and served with plain attention


def test_float32_attention_under_autocast_matches_plain_attention():
    model = build_model(train_tokenizer(), seed=0).eval()
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        use_fp32_attention(model)
        assert model.config._attn_implementation == "fp32_sdpa"
        got = model(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(input_ids=ids).logits
        use_fp32_attention(model, on=False)
    torch.testing.assert_close(got, ref)
    assert (low.float() - ref).abs().max() < 0.1  # bfloat16 matrix products, same model


def test_precision_names(monkeypatch):
    import scripts.demo.speed as speed

    assert resolve_precision("float32") == "float32" and resolve_precision("bfloat16") == "bfloat16"
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(speed, "native_bfloat16", lambda native=native: native)
        assert resolve_precision("auto") == want
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("fp8")
