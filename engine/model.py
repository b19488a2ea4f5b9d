"""The served model: optional vision encoder + projector, and the text decoder over the paged KV pool."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata, LayerKV
from engine.config import ModelConfig
from engine.loader import load_weights
from engine.text_model import TextModel
from engine.vision import VisionEncoder


class LlavaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg) if cfg.vision is not None else None
        self.text = TextModel(cfg.text)

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> LlavaModel:
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        for buf in model.buffers():  # buffers are not in the checkpoint
            buf.zero_()
        with torch.no_grad():
            load_weights(model, Path(model_dir), cfg.text.num_experts, dtype)
            for layer in model.text.layers:
                layer.self_attn.finalize()
        return model.eval().requires_grad_(False)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens_per_image, hidden] in the model dtype."""
        assert self.vision is not None, "model has no vision tower"
        return self.vision(pixel_values)

    def forward(self, input_ids: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: list[LayerKV],
                mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] -> hidden [T, H]. ``mm`` = (flat token indices [M], features [M, H]) spliced over the
        embeddings of image placeholder tokens."""
        ids = input_ids.clamp(max=self.cfg.text.vocab_size - 1)
        embeds = self.text.embed_tokens(ids)
        if mm is not None:
            embeds.index_copy_(0, mm[0], mm[1].to(embeds.dtype))
        return self.text(embeds, rope, meta, kv_cache)
