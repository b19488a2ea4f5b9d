"""Checkpoint loading: safetensors (single file or sharded index) in either LLaVA key layout.

Layouts accepted (prefixes are normalised, then tensors fused into the runtime's layout):

* transformers-5 in-memory names: ``model.language_model.*``, ``model.vision_tower.*``,
  ``model.multi_modal_projector.*``, ``lm_head.*``; MoE experts fused as ``experts.gate_up_proj [E, 2I, H]`` and
  ``experts.down_proj [E, H, I]``;
* the published llava-hf names (also what ``save_pretrained`` writes): ``language_model.model.*``,
  ``language_model.lm_head.*``, ``vision_tower[.vision_model].*``, ``multi_modal_projector.*``; per-expert tensors
  ``experts.N.{gate,up,down}_proj.weight`` (Qwen3-MoE) or ``block_sparse_moe.experts.N.w{1,3,2}.weight`` (Mixtral);
* a bare text model (``model.*``, ``lm_head.*``);
* Qwen3.5(-MoE): as Qwen3-VL below, experts one tensor per expert (``mlp.experts.N.{gate,up,down}_proj.weight``,
  what transformers 5 saves and the released checkpoints hold) or fused as in memory (``[E, 2I, H]`` / ``[E, H, I]``);
  the shared expert's gate/up are fused like a dense MLP's; GDN tensors (``linear_attn.*``) keep their names;
  multi-token-prediction heads (``mtp.*``) are ignored;
* Qwen3-VL(-MoE): ``model.language_model.*``, ``model.visual.*``, ``lm_head.*``; fused experts
  ``experts.gate_up_proj`` / ``experts.down_proj`` either as transformers 5 saves them (``[E, 2I, H]`` /
  ``[E, H, I]``) or as the released checkpoints store them, transposed (``[E, H, 2I]`` / ``[E, I, H]``): the shape
  tells, and where it cannot (``2I == H``) the checkpoint's ``transformers_version`` does
  (``ModelConfig.expert_layout_hint``).

Prefixes are normalised here (text tensors to ``text.*``, tower and projector tensors to ``vision.*``); the names
inside a vision tower are its family's (:meth:`engine.config.ModelFamily.vision_checkpoint_key`).

The runtime fuses q/k/v into one projection and gate/up into one, so the loader concatenates them here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.config import ModelConfig, ModelFamily
from engine.errors import CheckpointError

_PREFIXES = (
    ("model.language_model.", "text."), ("language_model.model.", "text."), ("language_model.lm_head.", "text.lm_head."),
    ("lm_head.", "text.lm_head."), ("model.visual.", "vision."), ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."), ("model.multi_modal_projector.", "vision."), ("multi_modal_projector.", "vision."),
    ("model.", "text."),
)
_IGNORED = re.compile(r"position_ids$|rotary_emb\.inv_freq$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot parse {index}: {e}") from None
        files = [model_dir / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) missing in {model_dir}: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def canonical_name(key: str, family: ModelFamily | None = None) -> str | None:
    """Map a checkpoint key to ``text.*`` / ``vision.*`` runtime-side names (before fusion); None = ignore.

    ``family`` (the checkpoint's) names its vision tower's tensors; without it they keep their stored names (enough
    for text tensors, which every family names alike)."""
    for prefix, repl in _PREFIXES:
        if key.startswith(prefix):
            key = repl + key[len(prefix):]
            break
    else:
        return None
    if key.startswith("vision."):
        inner = key[len("vision."):] if family is None else family.vision_checkpoint_key(key[len("vision."):])
        return None if inner is None else "vision." + inner
    key = key.replace("block_sparse_moe.", "mlp.")
    key = re.sub(r"experts\.(\d+)\.(w[123])\.", lambda m: f"experts.{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.", key)
    key = re.sub(r"(q_norm|k_norm|input_layernorm|post_attention_layernorm)\.weight$", r"\1", key)
    key = "text.norm" if key == "text.norm.weight" else key
    return None if _IGNORED.search(key) else key


def read_tensors(model_dir: Path, family: ModelFamily | None = None,
                 skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = canonical_name(key, family)
                    if name is not None and not (skip and name.startswith(skip)):
                        tensors[name] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
    return tensors


def _pop_cat(t: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([t.pop(n) for n in names], dim=0)


def fuse(t: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Concatenate q/k/v and gate/up, stack per-expert tensors. Mutates and returns ``t``."""
    for key in [k for k in t if k.endswith(".q_proj.weight") or k.endswith(".q_proj.bias")]:
        base, kind = key.rsplit(".q_proj.", 1)
        names = [f"{base}.{p}_proj.{kind}" for p in "qkv"]
        if all(n in t for n in names):
            target = "qkv" if base.startswith("vision.") else "qkv_proj"
            t[f"{base}.{target}.{kind}"] = _pop_cat(t, names)
    for key in [k for k in t if k.endswith(("mlp.gate_proj.weight", "mlp.shared_expert.gate_proj.weight"))]:
        base = key[: -len("gate_proj.weight")]
        t[f"{base}gate_up_proj.weight"] = _pop_cat(t, [f"{base}gate_proj.weight", f"{base}up_proj.weight"])
    layers = sorted({m[1] for k in t if (m := re.match(r"(text\.layers\.\d+\.mlp\.)experts\.\d+\.", k))})
    for base in layers:
        try:
            gu = [torch.cat([t.pop(f"{base}experts.{e}.gate_proj.weight"), t.pop(f"{base}experts.{e}.up_proj.weight")])
                  for e in range(num_experts)]
            down = [t.pop(f"{base}experts.{e}.down_proj.weight") for e in range(num_experts)]
        except KeyError as e:
            raise CheckpointError(f"checkpoint is missing expert tensor {e.args[0]}") from None
        t[f"{base}gate_up_proj"], t[f"{base}down_proj"] = torch.stack(gu), torch.stack(down)
    for key in [k for k in t if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")]:
        t[key.replace("experts.", "")] = t.pop(key)
    return t


def load_weights(model: nn.Module, model_dir: Path, cfg: ModelConfig, family: ModelFamily,
                 dtype: torch.dtype, skip: tuple[str, ...] = ()) -> None:
    """Fill ``model`` (a :class:`engine.model.LlavaModel` of ``cfg``, built by ``family``) from ``model_dir``; raise
    CheckpointError on any mismatch. Tensors named with a prefix in ``skip`` are left unread (a part not built)."""
    tensors = fuse(read_tensors(model_dir, family, skip), cfg.text.num_experts)
    if "text.lm_head.weight" not in tensors and "text.embed_tokens.weight" in tensors:
        tensors["text.lm_head.weight"] = tensors["text.embed_tokens.weight"]
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, param in expected.items():
        src = _expert_layout(name, tensors[name], param.shape, cfg.expert_layout_hint)
        if src.shape != param.shape:
            raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(src.shape)} != expected {tuple(param.shape)}")
        param.copy_(src.to(dtype))
    unexpected = [k for k in tensors if k not in expected and not family.unused_checkpoint_tensor(k, cfg)]
    if unexpected:
        raise CheckpointError(f"checkpoint {model_dir} has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")


def _expert_layout(name: str, src: torch.Tensor, want: torch.Size, hint: str) -> torch.Tensor:
    """Fused expert tensors stored transposed (the released Qwen3-VL-MoE layout) -> the runtime's ``[E, out, in]``."""
    if src.dim() != 3 or not name.endswith(("mlp.gate_up_proj", "mlp.down_proj")):
        return src
    flipped = (want[0], want[2], want[1])
    if tuple(src.shape) == flipped and (tuple(src.shape) != tuple(want) or hint == "published"):
        return src.transpose(1, 2)
    return src
