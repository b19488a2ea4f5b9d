"""The LLaVA vision tower's configuration (:class:`VisionConfig`: SigLIP or CLIP, a fixed image size), parsed from a
LLaVA ``config.json``'s ``vision_config``. Kept apart from the tower (:mod:`engine.models.llava.vision`) so
:mod:`engine.config` can name the type without importing modules."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import CheckpointError, UnsupportedModelError
from engine.text_config import check_act

SUPPORTED_VISION_MODELS = ("siglip_vision_model", "clip_vision_model")


@dataclass(frozen=True)
class VisionConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def has_cls_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.has_cls_token)


def parse_vision_config(v: dict) -> VisionConfig:
    mt = v.get("model_type")
    if mt not in SUPPORTED_VISION_MODELS:
        raise UnsupportedModelError(f"unsupported vision model_type {mt!r} (supported: {', '.join(SUPPORTED_VISION_MODELS)})")
    default_act = "quick_gelu" if mt == "clip_vision_model" else "gelu_pytorch_tanh"
    try:
        return VisionConfig(
            model_type=mt, hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
            image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
            num_channels=int(v.get("num_channels", 3)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-5 if mt == "clip_vision_model" else 1e-6)),
            hidden_act=check_act(v.get("hidden_act", default_act), "vision"),
        )
    except KeyError as e:
        raise CheckpointError(f"vision config is missing {e.args[0]!r}") from None
