"""The Qwen3.5 family (``qwen3_5_moe``, ``qwen3_5``): Qwen3-VL's vision tower and prompt layout (without DeepStack)
over a hybrid decoder (:mod:`engine.models.qwen3_5.model`: Gated DeltaNet layers with a per-sequence state,
interleaved with gated full attention; text config in :mod:`engine.models.qwen3_5.config`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import UnsupportedModelError
from engine.models.qwen3_5.config import QWEN35_MODELS, base_text_dict, gdn_config, layer_types
from engine.models.qwen3_5.model import HybridTextModel
from engine.models.qwen3_vl.family import QwenVLFamily
from engine.text_config import TextConfig, parse_decoder_config


class Qwen35Family(QwenVLFamily):
    """:class:`engine.config.ModelFamily` of Qwen3.5 checkpoints: Qwen3-VL's, except for the text model."""

    models = QWEN35_MODELS

    def parse_text_config(self, t: dict[str, Any]) -> TextConfig:
        """Hybrid GDN / gated-attention layers, partial M-RoPE (:mod:`engine.models.qwen3_5.config`)."""
        sparse = self._text_sparse(t)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        if not rope.get("mrope_interleaved", True):
            raise UnsupportedModelError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
        if t.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"Qwen3.5 with hidden_act {t.get('hidden_act')!r} (only silu)")
        cfg = parse_decoder_config(base_text_dict(t, sparse=sparse))
        rotary = int(cfg.head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))))
        section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))
        if rotary % 2 or not 0 < rotary <= cfg.head_dim or len(section) != 3 or 2 * sum(section) != rotary:
            raise UnsupportedModelError(f"mrope_section {list(section)} must have 3 entries summing to the rotary "
                                        f"dim / 2 = {rotary // 2}")
        shared = int(t.get("shared_expert_intermediate_size", 0) or 0) if sparse else 0
        return dataclasses.replace(cfg, model_type=t["model_type"], mrope_section=section, qk_norm=True,  # type: ignore[arg-type]
                                   layer_types=layer_types(t, cfg.num_layers), gdn=gdn_config(t),
                                   shared_expert_intermediate_size=shared, attn_output_gate=True, rotary_dim=rotary,
                                   router_weights_in_model_dtype=False)

    def build_text(self, cfg: TextConfig) -> HybridTextModel:
        return HybridTextModel(cfg)


FAMILY = Qwen35Family()
