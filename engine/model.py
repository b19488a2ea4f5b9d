"""The served model: optional vision encoder (+ projector), and the text decoder over the paged KV pool.

One class for every family: the checkpoint's model family (:func:`engine.config.model_family`) builds its vision
tower (a LLaVA tower, fixed-size images, :mod:`engine.models.llava.vision`; or a Qwen3-VL tower, native-resolution
images and DeepStack features, :mod:`engine.models.qwen3_vl.vision`) and the family of its text config builds the
decoder (:class:`engine.text_model.TextModel`, or Qwen3.5's hybrid)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import engine.tuning_cache as tuning_cache
from engine.attention import AttentionMetadata, LayerKV
from engine.config import ModelConfig, model_family
from engine.cpu_linear import pack_linears, tuning_turn
from engine.loader import load_weights
from engine.models.llava.vision import VisionEncoder
from engine.models.qwen3_vl.vision import QwenVisionTower
from engine.state_cache import LayerState
from engine.text_model import TextModel

# (flat token indices [M], features [M, H], DeepStack features [levels, M, H] or None)
MultiModalRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised storage on ``device``,
    floating ones in ``dtype`` (a tensor shared by two modules stays shared). What ``to_empty(device).to(dtype)``
    does, without its meta-tensor path, whose first use imports sympy: 0.3 s of every worker's start."""
    # id(meta tensor) -> (the meta tensor, held so that no id is reused while the table lives; its replacement)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = t, nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)][1]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = empty(t)


class LlavaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vision_tower: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision: nn.Module | None = None
        if cfg.vision is not None and vision_tower:
            self.vision = model_family(cfg.model_type).build_vision(cfg)
        self.text: TextModel = model_family(cfg.text.model_type, text=True).build_text(cfg.text)
        self.linear_kernels = {"layers": 0, "packed": 0, "few_rows": 0, "moe_one_call_upto": [],
                               "layer_call_upto": 0}  # set at load on
        # CPU (engine.cpu_linear.pack_linears)

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
             cpu_linear: str = "auto", vision_tower: bool = True) -> LlavaModel:
        """``cpu_linear``: how linear layers run on CPU (:func:`engine.cpu_linear.pack_linears`). ``vision_tower``
        False: the checkpoint's tower is left unread (``vision.*``: the model then encodes no images)."""
        with torch.device("meta"):
            model = cls(cfg, vision_tower)
        materialize(model, torch.device(device), dtype)
        for buf in model.buffers():  # buffers are not in the checkpoint
            buf.zero_()
        with torch.no_grad():
            load_weights(model, Path(model_dir), cfg, model_family(cfg.model_type), dtype,
                         skip=() if vision_tower or cfg.vision is None else ("vision.",))
            model.text.finalize()
            if torch.device(device).type == "cpu":  # kernel choices: measured, or this host's cached answers
                with tuning_turn():
                    tuning_cache.refresh()  # what the process that held the turn before just measured
                    model.linear_kernels = pack_linears(model, cpu_linear, take_turn=False)
                    model.linear_kernels["layer_call_upto"] = model.text.choose_one_call()
                    tuning_cache.save()
        return model.eval().requires_grad_(False)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """LLaVA: [N, C, H, W] -> [N, tokens_per_image, hidden] in the model dtype."""
        assert isinstance(self.vision, VisionEncoder), "model has no LLaVA vision tower"
        return self.vision(pixel_values)

    def encode_grid_images(self, patches: torch.Tensor, grid_thw: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Qwen3-VL: patches [P, C*T*p*p] of N images, grid_thw [N, 3] -> (features [tokens, hidden], DeepStack
        features [levels, tokens, hidden] or None), images in order, each attending only within itself."""
        assert isinstance(self.vision, QwenVisionTower), "model has no Qwen3-VL vision tower"
        feats, deepstack = self.vision(patches, grid_thw)
        return feats, torch.stack(deepstack) if deepstack else None

    def forward(self, input_ids: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: list[LayerKV | LayerState], mm: MultiModalRows | None = None) -> torch.Tensor:
        """input_ids [T] -> hidden [T, H]. ``mm`` = (flat token indices [M], features [M, H], DeepStack [L, M, H])
        spliced over the embeddings of image placeholder tokens; DeepStack level i is added to those rows after
        decoder layer i."""
        ids = input_ids.clamp(max=self.cfg.text.vocab_size - 1)
        embeds = self.text.embed_tokens(ids)
        deepstack = None
        if mm is not None:
            embeds.index_copy_(0, mm[0], mm[1].to(embeds.dtype))
            if mm[2] is not None:
                deepstack = (mm[0], mm[2].to(embeds.dtype))
        return self.text(embeds, rope, meta, kv_cache, deepstack)
