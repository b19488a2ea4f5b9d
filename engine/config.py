"""Model and engine configuration.

:class:`ModelConfig` is parsed from a checkpoint's ``config.json`` and validated on construction: anything the
engine cannot run exactly as the reference does is rejected with :class:`UnsupportedModelError` before any weight is
read. The parsing itself belongs to the checkpoint's model family (:class:`ModelFamily`, a package under
:mod:`engine.models` found by ``model_type`` through :mod:`engine.models.registry`). :class:`EngineConfig` holds the
serving knobs (dtype, KV pool size, batching limits).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from engine.coded_kv import MODES as CODED_MODES
from engine.errors import CheckpointError, InvalidRequestError
from engine.models.llava.config import VisionConfig
from engine.models.qwen3_vl.config import QwenVisionConfig
from engine.models.registry import family_module
from engine.scheduler import POLICIES
from engine.text_config import TextConfig

if TYPE_CHECKING:
    from engine.image_processor import ImageProcessor
    from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
    from engine.text_model import TextModel

__all__ = ["DTYPES", "EngineConfig", "ModelConfig", "ModelFamily", "TextConfig", "VisionConfig", "model_family",
           "parse_config", "parse_device", "parse_text_config"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a checkpoint: the LLaVA architecture (``family == "llava"``, a
    fixed number of visual tokens per image) or a Qwen3-VL family (``"qwen3_vl"``, Qwen3.5 too: native-resolution
    vision, the visual-token count follows each image's grid, M-RoPE, DeepStack; Qwen3.5's hybrid text model is
    ``TextConfig.is_hybrid``). ``family`` names the prompt layout; ``model_type`` (``config.json``'s) the
    :class:`ModelFamily` that parsed the checkpoint and builds its model."""

    text: TextConfig
    vision: VisionConfig | QwenVisionConfig | None
    image_token_index: int | None
    image_seq_length: int
    vision_feature_layers: tuple[int, ...]
    vision_feature_select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    family: str = "llava"
    vision_start_token_id: int | None = None  # qwen3_vl: <|vision_start|> (precedes each image's placeholders)
    vision_end_token_id: int | None = None
    video_token_id: int | None = None
    expert_layout_hint: str = "hf"  # qwen3_vl_moe fused experts when shapes cannot tell: "hf" or "published"
    model_type: str = "llava"  # config.json's top-level model_type (engine.models.registry)

    @property
    def is_qwen_vl(self) -> bool:
        return self.family == "qwen3_vl"

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.vision.deepstack_visual_indexes) if isinstance(self.vision, QwenVisionConfig) else 0

    @property
    def tokens_per_image(self) -> int:
        """Number of placeholder tokens (and projected features) one image expands to (LLaVA; a Qwen3-VL image's
        count follows its grid: ``QwenVisionConfig.tokens_for_grid``)."""
        assert isinstance(self.vision, VisionConfig), "only LLaVA checkpoints have a fixed number of tokens per image"
        drop = 1 if self.vision_feature_select_strategy == "default" else 0
        return self.vision.num_positions - drop

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"no config.json in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot parse {cfg_file}: {e}") from None
        gen = _read_optional_json(path / "generation_config.json")
        return parse_config(raw, gen)


def _read_optional_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot parse {file}: {e}") from None


class ModelFamily(Protocol):
    """What a model family provides the runtime: the ``FAMILY`` of ``engine/models/<name>/family.py``, found by
    ``model_type`` through :mod:`engine.models.registry` (:func:`model_family`).

    The engine calls every method once per model load, on one thread; none keeps state between calls. Config
    parsing raises :class:`UnsupportedModelError` / :class:`CheckpointError`, never a bare ``KeyError``."""

    def parse_config(self, raw: dict[str, Any], generation_config: dict[str, Any]) -> ModelConfig:
        """``config.json`` (top-level ``model_type`` one of this family's) and ``generation_config.json`` ({} when
        absent) -> the validated config."""
        ...

    def parse_text_config(self, t: dict[str, Any]) -> TextConfig:
        """A text config whose ``model_type`` is one of this family's -> its decoder's config."""
        ...

    def build_vision(self, cfg: ModelConfig) -> nn.Module | None:
        """The vision tower (with its projector / mergers) of a checkpoint of this family; None without one."""
        ...

    def build_text(self, cfg: TextConfig) -> TextModel:
        """The decoder for a text config of this family."""
        ...

    def image_processor(self, model_dir: Path, cfg: ModelConfig) -> ImageProcessor | QwenVLImageProcessor | None:
        """The checkpoint's image preprocessing (None for a text-only model)."""
        ...

    def vision_checkpoint_key(self, key: str) -> str | None:
        """A tower tensor's checkpoint name after its prefix (``model.vision_tower.``, ``model.visual.``, ...) -> the
        tower's parameter name under ``vision.``; None: the tensor is not loaded."""
        ...

    def unused_checkpoint_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """Whether the checkpoint may hold runtime-side ``name`` although the built model has no parameter for it."""
        ...


def model_family(model_type: object, *, text: bool = False) -> ModelFamily:
    """The family serving ``model_type`` (a ``config.json``'s, or with ``text`` a text config's), imported on first
    use; :class:`UnsupportedModelError` for an unknown one."""
    return importlib.import_module(family_module(model_type, text=text)).FAMILY


def parse_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    """Parse a ``config.json`` dict (a multimodal ``model_type`` such as ``llava``, or a bare supported text model)."""
    return model_family(raw.get("model_type")).parse_config(raw, generation_config or {})


def parse_text_config(t: dict) -> TextConfig:
    """Parse a text config (``config.json``'s ``text_config``, or a bare text model's ``config.json``)."""
    return model_family(t.get("model_type"), text=True).parse_text_config(t)


VISION_CACHE_SHARE = 0.1  # of kv_cache_memory_gb, for the vision cache unless vision_cache_mb is set


@dataclass
class EngineConfig:
    """Serving knobs. Validated on construction; see the README for defaults."""

    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # encoded images kept for reuse (engine.vision_cache): at most vision_cache_size of them and vision_cache_mb MiB
    # (None: a tenth of kv_cache_memory_gb), in KV blocks no sequence uses, given back first when KV needs them; an
    # image over the whole byte bound is encoded for its request, not kept
    vision_cache_size: int = 64
    vision_cache_mb: float | None = None
    # Qwen3-VL: run the vision tower ahead of scheduling, in slices of about this many seconds (whole blocks, at
    # least one) at the start of each step; a prompt joins the scheduler once its images are encoded, so prompts
    # without images to encode pass those being encoded. None: each image is encoded whole in the step that first
    # schedules its prompt (a text prompt arriving then waits for the whole tower call).
    vision_slice_s: float | None = None
    # decode staging (engine.decode_mirror) reserved at start for max_num_seqs sequences of this many tokens; None:
    # grown on demand (each growth copies it: ~0.1 s at 16 -> 32 sequences of 2048 tokens, a stall of every decode)
    decode_mirror_tokens: int | None = None
    # hybrid models (Qwen3.5): sequences that can hold a GDN state slot at once (running, prefilling or receiving a
    # transfer); None: max_num_seqs. Its memory comes off kv_cache_memory_gb before the KV pool is sized.
    max_num_state_slots: int | None = None
    # hybrid models' prefix cache: GDN state snapshots kept after chosen prompt blocks (engine.state_cache.Snapshots;
    # a hit resumes from the last one). None: as many as fit in a tenth of kv_cache_memory_gb, at least 1 and at
    # most 2 x max_num_seqs (max_num_seqs when num_kv_blocks fixes the pool); 0: no prefix cache for hybrid models.
    # Their memory comes off kv_cache_memory_gb like the state slots'. One is kept after the prompt's last block a
    # repeat can hit, after each image and every state_snapshot_every_blocks blocks (0: not periodically).
    state_snapshots: int | None = None
    state_snapshot_every_blocks: int = 16
    # CPU linear layers: "auto" times F.linear against oneDNN with a packed weight per weight shape at load and uses
    # the faster per row range; "packed" always packs, "native" never (engine.cpu_linear)
    cpu_linear: str = "auto"
    # False: the vision tower (and projector) is neither loaded nor tuned, and a prompt with pixels to encode is
    # refused: an engine whose prompts arrive with their images encoded elsewhere (a cluster's decode workers:
    # cluster.control.spec.ClusterSpec.engine_config)
    vision_tower: bool = True
    # how a received prompt's image blocks are kept (engine.coded_kv): "plain" in the model dtype, or "int8" coded
    # pages lent from the pool (about 2/7 of the memory at float32, 2/3 at 16-bit; decode attention reads the codes)
    visual_kv_cache: str = "plain"
    # share of the pool's blocks the elastic region (cached image features, coded visual pages) never takes: the
    # static text region's floor
    text_kv_floor: float = 0.1
    # the vision tower's workspace, kept out of kv_cache_memory_gb before the pool is sized (engines with a tower);
    # a prompt's images are encoded in as many tower calls as fit it, an image that alone does not is refused. None:
    # a step's worth of images (max_num_batched_tokens visual tokens), at least one largest, engine.workspace
    encoder_workspace_mb: float | None = None
    scheduling_policy: str = "fcfs"  # admission order: "fcfs" or "shortest" (engine.scheduler)
    scheduling_max_wait_s: float = 10.0  # "shortest": a prompt waiting this long goes first
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_num_state_slots is not None and self.max_num_state_slots < 1:
            raise ValueError("max_num_state_slots must be >= 1 (or None)")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError("state_snapshots must be >= 0 (or None)")
        if self.state_snapshot_every_blocks < 0:
            raise ValueError("state_snapshot_every_blocks must be >= 0")
        if self.vision_cache_size < 0:
            raise ValueError("vision_cache_size must be >= 0")
        if not isinstance(self.vision_tower, bool):
            raise ValueError(f"vision_tower must be true or false, got {self.vision_tower!r}")
        if self.vision_cache_mb is not None and not self.vision_cache_mb >= 0:
            raise ValueError("vision_cache_mb must be >= 0 (or None)")
        if self.decode_mirror_tokens is not None and self.decode_mirror_tokens < 1:
            raise ValueError("decode_mirror_tokens must be >= 1 (or None)")
        if self.visual_kv_cache not in CODED_MODES:
            raise ValueError(f"visual_kv_cache must be one of {list(CODED_MODES)}, got {self.visual_kv_cache!r}")
        if isinstance(self.text_kv_floor, bool) or not isinstance(self.text_kv_floor, (int, float)) \
                or not 0 <= self.text_kv_floor <= 1:
            raise ValueError(f"text_kv_floor must be a number in [0, 1], got {self.text_kv_floor!r}")
        if self.encoder_workspace_mb is not None and not self.encoder_workspace_mb >= 0:
            raise ValueError("encoder_workspace_mb must be >= 0 (or None)")
        if self.cpu_linear not in ("auto", "packed", "native"):
            raise ValueError(f"cpu_linear must be 'auto', 'packed' or 'native', got {self.cpu_linear!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {self.scheduling_policy!r}")
        if self.vision_slice_s is not None and not self.vision_slice_s > 0:
            raise ValueError("vision_slice_s must be > 0 (or None)")
        if not self.scheduling_max_wait_s > 0:
            raise ValueError("scheduling_max_wait_s must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    @property
    def vision_cache_bytes(self) -> int:
        mb = self.vision_cache_mb
        if mb is None:
            mb = self.kv_cache_memory_gb * 1024 * VISION_CACHE_SHARE
        return int(mb * 2**20)

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        name = model.torch_dtype if self.dtype == "auto" else self.dtype
        return DTYPES.get(name, torch.float32)


def parse_device(name: str) -> torch.device:
    """``torch.device(name)`` for the device types the engine runs on; anything else is a typed, one-line error."""
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists every device type it knows
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"unsupported device {name!r} (use 'cpu' or 'cuda[:N]')")
    return device
