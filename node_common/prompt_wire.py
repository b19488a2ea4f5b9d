"""A processed prompt on the wire: what the front-end sends each worker once it has validated, tokenized and decoded
the prompt's images (one pass over a prompt; the workers neither re-tokenize nor re-decode).

The front-end runs :meth:`engine.inputs.InputProcessor.process` once and sends two maps (msgpack, inside the
control message of :mod:`node_common.messages`):

* the prefill worker's (``for_encoder=True``) carries the images' preprocessed pixels (the processor's float32
  output: LLaVA ``[N, C, H, W]``, Qwen3-VL patches ``[sum t*h*w, patch_dim]``) and, for M-RoPE models, the prompt's
  3-D positions -- everything its vision tower and prefill need;
* the decode worker's carries no image data at all: token ids, the images' content hashes and placeholder positions
  (its prefix-cache block hashes and KV compression's visual mask) and the M-RoPE delta (checked against the
  hand-off's). Such a prompt cannot be recomputed on the decode side: see :mod:`decode_node.worker`.

Version 2 (``"v": 2``)::

    {"v": 2, "token_ids": [int], "text": str | None,
     "mm": None | {"hashes": [bytes], "positions": array, "token_counts": [int], "tokens_per_image": int,
                   "grid_thw": [[t, h, w]] | None, "mrope_delta": int,
                   "mrope": array | None, "pixels": array | None}}      # the last two: prefill only
    array = {"dtype": "float32" | "int64", "shape": [int], "data": bytes (C order, little-endian)}

Version 1 (no ``"v"``: ids plus the images re-encoded as PNG, which every worker decoded and processed again) is
no longer accepted; any other version or shape is a :class:`PromptWireError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.inputs import ProcessedPrompt
from engine.sequence import MultiModalInput
from node_common.messages import MessageError

PROMPT_VERSION = 2
_DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


class PromptWireError(MessageError):
    """A prompt map could not be decoded (wrong version or shape)."""


def prompt_to_wire(p: ProcessedPrompt, *, for_encoder: bool) -> dict[str, Any]:
    """The msgpack-able map of ``p`` for a worker that runs the vision tower (``for_encoder``: pixels and M-RoPE
    positions included; evaluates deferred pixels) or one that only decodes (no image data)."""
    mm = p.mm
    wire: dict[str, Any] = {"v": PROMPT_VERSION, "token_ids": list(p.token_ids), "text": p.prompt, "mm": None}
    if mm is None:
        return wire
    wire["mm"] = {"hashes": list(mm.image_hashes), "positions": _array(mm.positions),
                  "token_counts": list(mm.token_counts or []), "tokens_per_image": int(mm.tokens_per_image),
                  "grid_thw": None if mm.grid_thw is None else np.asarray(mm.grid_thw).tolist(),
                  "mrope_delta": int(mm.mrope_delta),
                  "mrope": _array(mm.mrope) if for_encoder and mm.mrope is not None else None,
                  "pixels": _array(mm.pixels()) if for_encoder else None}
    return wire


def prompt_from_wire(d: Any) -> ProcessedPrompt:
    """Inverse of :func:`prompt_to_wire`: the :class:`ProcessedPrompt` the engine takes as it is
    (``LLMEngine.add_request``; its pixels are None on the decode side). Raises :class:`PromptWireError`."""
    if not isinstance(d, dict) or d.get("v") != PROMPT_VERSION:
        got = d.get("v", 1) if isinstance(d, dict) else type(d).__name__
        raise PromptWireError(f"prompt wire version {got!r} is not supported (expected {PROMPT_VERSION})")
    try:
        ids, text, m = d["token_ids"], d.get("text"), d.get("mm")
        if not isinstance(ids, list) or not (text is None or isinstance(text, str)):
            raise TypeError("token_ids must be a list and text a str or None")
        if m is None:
            return ProcessedPrompt(text, ids, None)
        grid = m["grid_thw"]
        mm = MultiModalInput(
            pixel_values=None if m["pixels"] is None else torch.from_numpy(_from_array(m["pixels"], "float32")),
            image_hashes=[bytes(h) for h in m["hashes"]], positions=_from_array(m["positions"], "int64"),
            tokens_per_image=int(m["tokens_per_image"]), token_counts=[int(c) for c in m["token_counts"]],
            grid_thw=None if grid is None else np.asarray(grid, dtype=np.int64).reshape(-1, 3),
            mrope=None if m["mrope"] is None else _from_array(m["mrope"], "int64"), mrope_delta=int(m["mrope_delta"]))
        return ProcessedPrompt(text, ids, mm)
    except (KeyError, TypeError, ValueError) as e:
        raise PromptWireError(f"malformed prompt: {e!r}") from None


def _array(a: np.ndarray | torch.Tensor) -> dict[str, Any]:
    x = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    name = "float32" if x.dtype.kind == "f" else "int64"
    x = np.ascontiguousarray(x, dtype=_DTYPES[name])
    return {"dtype": name, "shape": list(x.shape), "data": x.tobytes()}


def _from_array(d: dict, want: str) -> np.ndarray:
    if d.get("dtype") != want:
        raise ValueError(f"array dtype {d.get('dtype')!r}, expected {want!r}")
    shape, data = [int(s) for s in d["shape"]], d["data"]
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape)) * _DTYPES[want].itemsize:
        raise ValueError(f"array data does not hold shape {shape}")
    return np.frombuffer(data, dtype=_DTYPES[want]).reshape(shape).copy()  # writable, owned by the engine
