"""The LLaVA family: a decoder of :data:`engine.text_config.DECODER_MODELS` (``config.json`` ``model_type`` ``llava``
with a ``text_config``, or one of those decoders bare) and an optional SigLIP / CLIP tower with the LLaVA projector
(:mod:`engine.models.llava.vision`); every image is one fixed number of placeholder tokens.

Checkpoint tower names (llava-hf's ``vision_tower[.vision_model].embeddings.*`` / ``encoder.layers.N.*``,
transformers 5's ``model.vision_tower.*``) map to the runtime's flat ``vision.*`` names here
(:meth:`LlavaFamily.vision_checkpoint_key`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from torch import nn

from engine.config import ModelConfig, parse_text_config
from engine.errors import CheckpointError, UnsupportedModelError
from engine.image_processor import ImageProcessor
from engine.models.llava.config import VisionConfig, parse_vision_config
from engine.models.llava.vision import VisionEncoder
from engine.text_config import TextConfig, as_tuple, check_act, parse_decoder_config
from engine.text_model import TextModel

logger = logging.getLogger(__name__)
# tower tensors the runtime has no module for (SigLIP's pooling head, the post-layernorm LLaVA never reads)
_IGNORED = re.compile(r"^(head\.|post_layernorm\.)|position_ids$|rotary_emb\.inv_freq$")
_TOWER_RENAMES = (("vision_model.", ""), ("embeddings.", ""), ("encoder.layers.", "layers."), ("self_attn.", ""),
                  ("mlp.", ""))


class LlavaFamily:
    """:class:`engine.config.ModelFamily` of LLaVA checkpoints and bare decoders."""

    def parse_config(self, raw: dict[str, Any], generation_config: dict[str, Any]) -> ModelConfig:
        mt = raw.get("model_type")
        vision: VisionConfig | None
        if mt == "llava":
            text = parse_text_config(raw.get("text_config") or {})
            vision = parse_vision_config(raw.get("vision_config") or {})
        else:
            text, vision = parse_decoder_config(raw), None
        layers = as_tuple(raw.get("vision_feature_layer", -2))
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"unsupported vision_feature_select_strategy {strategy!r}")
        if vision is not None:
            for layer in layers:
                if not -(vision.num_layers + 1) <= layer <= vision.num_layers:
                    raise CheckpointError(f"vision_feature_layer {layer} out of range for {vision.num_layers} layers")
        gen = generation_config
        eos = (as_tuple(gen.get("eos_token_id")) or as_tuple((raw.get("text_config") or raw).get("eos_token_id"))
               or as_tuple(raw.get("eos_token_id")))
        cfg = ModelConfig(
            text=text, vision=vision,
            image_token_index=raw.get("image_token_index", raw.get("image_token_id")) if vision else None,
            image_seq_length=int(raw.get("image_seq_length", 0) or 0), vision_feature_layers=layers,
            vision_feature_select_strategy=strategy,
            projector_hidden_act=check_act(raw.get("projector_hidden_act", "gelu"), "projector"),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)), eos_token_ids=eos,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
                            or "float32"),
            model_type=str(mt),
        )
        if vision is not None and cfg.image_seq_length and cfg.image_seq_length != cfg.tokens_per_image:
            logger.warning("config image_seq_length %d differs from the %d features the vision tower yields per "
                           "image; using %d", cfg.image_seq_length, cfg.tokens_per_image, cfg.tokens_per_image)
        return cfg

    def parse_text_config(self, t: dict[str, Any]) -> TextConfig:
        return parse_decoder_config(t)

    def build_vision(self, cfg: ModelConfig) -> nn.Module | None:
        return None if cfg.vision is None else VisionEncoder(cfg)

    def build_text(self, cfg: TextConfig) -> TextModel:
        return TextModel(cfg)

    def image_processor(self, model_dir: Path, cfg: ModelConfig) -> ImageProcessor | None:
        if not isinstance(cfg.vision, VisionConfig):
            return None
        return ImageProcessor.from_pretrained(model_dir, default_image_size=cfg.vision.image_size,
                                              vision_model_type=cfg.vision.model_type)

    def vision_checkpoint_key(self, key: str) -> str | None:
        for old, new in _TOWER_RENAMES:
            key = key.replace(old, new)
        key = key.replace("position_embedding.weight", "position_embedding")
        return None if _IGNORED.search(key) else key

    def unused_checkpoint_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """Tower layers after the deepest selected one (never run, so never built)."""
        m = re.match(r"vision\.layers\.(\d+)\.", name)
        kept = VisionEncoder.layers_run(cfg) if cfg.vision is not None else 0
        return m is not None and int(m[1]) >= kept


FAMILY = LlavaFamily()
