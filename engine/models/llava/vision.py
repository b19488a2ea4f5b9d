"""Vision tower (SigLIP or CLIP) and the LLaVA multi-modal projector.

``VisionEncoder.forward(pixel_values) -> [N, tokens_per_image, text_hidden]`` reproduces transformers'
``LlavaModel.get_image_features``: hidden states after the selected encoder layers (CLIP's pre-layernorm output is
hidden state 0), the first token dropped under the ``default`` strategy, layers concatenated on the channel axis, then
``linear_1 -> act -> linear_2``. Layers after the deepest selected one are never run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers import ACTIVATIONS, Linear
from engine.models.llava.config import VisionConfig


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.qkv = Linear(h, 3 * h)
        self.out_proj = Linear(h, h)
        self.fc1 = Linear(h, i)
        self.fc2 = Linear(i, h)
        self.num_heads = cfg.num_heads
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, h = x.shape
        q, k, v = self.qkv(self.layer_norm1(x)).view(n, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.out_proj(a.transpose(1, 2).reshape(n, s, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vision is not None
        v = cfg.vision
        self.cfg = v
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size, v.patch_size,
                                         bias=not v.has_cls_token)
        self.position_embedding = nn.Parameter(torch.empty(v.num_positions, v.hidden_size))
        if v.has_cls_token:
            self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
            self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.feature_layers = self._feature_layers(cfg)
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(self.layers_run(cfg)))
        self.drop_first = cfg.vision_feature_select_strategy == "default"
        in_dim = v.hidden_size * len(self.feature_layers)
        th = cfg.text.hidden_size
        self.linear_1 = Linear(in_dim, th, bias=cfg.projector_bias)
        self.linear_2 = Linear(th, th, bias=cfg.projector_bias)
        self.proj_act = ACTIVATIONS[cfg.projector_hidden_act]

    @staticmethod
    def _feature_layers(cfg: ModelConfig) -> list[int]:
        """hidden_states[i] is the output of layer i (0 = embeddings); negative indices count from the end."""
        assert cfg.vision is not None
        return [i % (cfg.vision.num_layers + 1) for i in cfg.vision_feature_layers]

    @classmethod
    def layers_run(cls, cfg: ModelConfig) -> int:
        """Encoder layers the tower builds and runs: up to the deepest selected one (a checkpoint's later layers are
        not loaded)."""
        return max(cls._feature_layers(cfg))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> image features [N, tokens_per_image, text_hidden]."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(dtype=w.dtype, device=w.device)).flatten(2).transpose(1, 2)
        if self.cfg.has_cls_token:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = self.pre_layrnorm(torch.cat([cls, x], dim=1) + self.position_embedding)
        else:
            x = x + self.position_embedding
        hidden = [x]
        for layer in self.layers:
            x = layer(x)
            hidden.append(x)
        selected = [hidden[i][:, 1:] if self.drop_first else hidden[i] for i in self.feature_layers]
        feats = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.linear_2(self.proj_act(self.linear_1(feats)))
