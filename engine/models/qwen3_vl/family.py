"""The Qwen3-VL family (``qwen3_vl_moe``, ``qwen3_vl``): Qwen3(-MoE) text layers with interleaved M-RoPE, and a
native-resolution vision tower with DeepStack features (:mod:`engine.models.qwen3_vl.vision`, images preprocessed by
:mod:`engine.models.qwen3_vl.image_processor`); an image's placeholder count follows its patch grid.

:class:`QwenVLFamily` also holds what every Qwen-VL-style family shares (Qwen3.5 subclasses it): the top-level
config (special token ids, the tower, the released checkpoints' expert layout) and the tower's checkpoint names
(``model.visual.X`` loads as ``vision.X``: the tower keeps transformers' names).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from engine.config import ModelConfig
from engine.errors import CheckpointError, UnsupportedModelError
from engine.models.qwen3_vl.config import QwenVisionConfig
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from engine.models.qwen3_vl.vision import QwenVisionTower
from engine.text_config import TextConfig, as_tuple, parse_decoder_config
from engine.text_model import TextModel

# model_type -> (its text config's model_type, whether its layers may be sparse)
QWEN_VL_MODELS = {"qwen3_vl_moe": ("qwen3_vl_moe_text", True), "qwen3_vl": ("qwen3_vl_text", False)}


class QwenVLFamily:
    """:class:`engine.config.ModelFamily` of Qwen3-VL checkpoints (and, through :attr:`models`, Qwen3.5's)."""

    models: dict[str, tuple[str, bool]] = QWEN_VL_MODELS

    def parse_config(self, raw: dict[str, Any], generation_config: dict[str, Any]) -> ModelConfig:
        mt = raw.get("model_type")
        if mt not in self.models:
            raise UnsupportedModelError(f"unsupported model_type {mt!r} (supported: {', '.join(self.models)})")
        text_type, _ = self.models[mt]
        t = dict(raw.get("text_config") or {})
        if t.get("model_type", text_type) != text_type:
            raise UnsupportedModelError(f"{mt} checkpoint with text model_type {t.get('model_type')!r} (expected {text_type})")
        t["model_type"] = text_type
        # the top-level flag governs the conditional-generation model's lm_head (transformers 5)
        t["tie_word_embeddings"] = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        text = self.parse_text_config(t)
        # Qwen3.5's tower is Qwen3-VL's without DeepStack
        vision = QwenVisionConfig.from_dict({"deepstack_visual_indexes": [], **(raw.get("vision_config") or {})})
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}")
        if len(vision.deepstack_visual_indexes) > text.num_layers:
            raise CheckpointError("more DeepStack levels than decoder layers")
        ids = {k: raw.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
        if ids["image_token_id"] is None:
            raise CheckpointError(f"{mt} config has no image_token_id")
        gen = generation_config
        eos = as_tuple(gen.get("eos_token_id")) or as_tuple(t.get("eos_token_id")) or as_tuple(raw.get("eos_token_id"))
        version = str(raw.get("transformers_version") or "")
        return ModelConfig(
            text=text, vision=vision, image_token_index=int(ids["image_token_id"]), image_seq_length=0,
            vision_feature_layers=(), vision_feature_select_strategy="full", projector_hidden_act="gelu",
            projector_bias=True, eos_token_ids=eos,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or t.get("dtype") or "float32"),
            family="qwen3_vl", vision_start_token_id=ids["vision_start_token_id"],
            vision_end_token_id=ids["vision_end_token_id"], video_token_id=ids["video_token_id"],
            # released checkpoints (written before transformers 5) store fused experts as [E, H, 2I] / [E, I, H]
            expert_layout_hint="hf" if version[:1].isdigit() and int(version.split(".")[0]) >= 5 else "published",
            model_type=mt,
        )

    def _text_sparse(self, t: dict[str, Any]) -> bool:
        """Whether text config ``t`` (of one of :attr:`models`' text model_types) may have sparse layers."""
        sparse = {text: sparse for text, sparse in self.models.values()}
        mt = t.get("model_type")
        if mt not in sparse:
            raise UnsupportedModelError(f"unsupported text model_type {mt!r} (supported: {', '.join(sparse)})")
        return sparse[mt]

    def parse_text_config(self, t: dict[str, Any]) -> TextConfig:
        """Qwen3(-MoE) layers with interleaved M-RoPE. The router always renormalises the top-k weights and casts
        them to the model dtype (transformers' ``Qwen3VLMoeTextTopKRouter``)."""
        sparse = self._text_sparse(t)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r} (only 'default' M-RoPE)")
        if not rope.get("mrope_interleaved", True):
            raise UnsupportedModelError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
        section = tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20)))
        base = {**t, "model_type": "qwen3_moe" if sparse else "qwen3", "rope_parameters": {
            "rope_type": "default", "rope_theta": rope.get("rope_theta", t.get("rope_theta", 5e5))}}
        if sparse:
            base["norm_topk_prob"] = True
        else:
            base.pop("num_experts", None), base.pop("num_local_experts", None)
        cfg = parse_decoder_config(base)
        half = cfg.head_dim // 2
        if len(section) != 3 or sum(section) != half:
            raise UnsupportedModelError(f"mrope_section {list(section)} must have 3 entries summing to head_dim/2 = {half}")
        return dataclasses.replace(cfg, model_type=t["model_type"], mrope_section=section)  # type: ignore[arg-type]

    def build_vision(self, cfg: ModelConfig) -> nn.Module | None:
        assert isinstance(cfg.vision, QwenVisionConfig)
        return QwenVisionTower(cfg.vision)

    def build_text(self, cfg: TextConfig) -> TextModel:
        return TextModel(cfg)

    def image_processor(self, model_dir: Path, cfg: ModelConfig) -> QwenVLImageProcessor:
        proc, v = QwenVLImageProcessor.from_pretrained(model_dir), cfg.vision
        assert isinstance(v, QwenVisionConfig)
        got = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
        want = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if got != want:
            raise CheckpointError(f"preprocessor_config.json (patch, temporal patch, merge) {got} != the vision "
                                  f"tower's {want}")
        return proc

    def vision_checkpoint_key(self, key: str) -> str | None:
        return key

    def unused_checkpoint_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return False


FAMILY = QwenVLFamily()
