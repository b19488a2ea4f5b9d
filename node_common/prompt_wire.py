"""A processed prompt on the wire: what the front-end sends each worker once it has validated, tokenized and decoded
the prompt's images (one pass over a prompt; the workers neither re-tokenize nor re-decode).

The front-end runs :meth:`engine.inputs.InputProcessor.process` once and sends two maps (msgpack, inside the
control message of :mod:`node_common.messages`):

* the prefill worker's (``for_encoder=True``) carries the images resized to uint8 ``[H, W, 3]`` (what the
  processor makes of them before rescaling, normalising and patching, which the worker then does itself: an eighth of
  the float32 input's bytes, a sixteenth for Qwen-VL, whose patches repeat each frame over time) and, for M-RoPE
  models, the prompt's 3-D positions -- everything its vision tower and prefill need;
* the decode worker's carries no image data at all: token ids, the images' content hashes and placeholder positions
  (its prefix-cache block hashes and KV compression's visual mask) and the M-RoPE delta (checked against the
  hand-off's). Such a prompt cannot be recomputed on the decode side: see :mod:`decode_node.worker`.

Version 3 (``"v": 3``)::

    {"v": 3, "token_ids": [int], "text": str | None,
     "mm": None | {"hashes": [bytes], "positions": array, "token_counts": [int], "tokens_per_image": int,
                   "grid_thw": [[t, h, w]] | None, "mrope_delta": int,
                   "mrope": array | None,                              # prefill only
                   "images": [array] | None,                           # prefill only: uint8 [H, W, 3] each
                   "pixels": array | None}}                            # prefill only: the float input, when a
                                                                       # prompt came with it computed
    array = {"dtype": "float32" | "int64" | "uint8", "shape": [int], "data": bytes (C order, little-endian)}

Version 2 (the same without ``"images"``: float32 pixels always) is still read. Version 1 (no ``"v"``: ids plus the images re-encoded as PNG, which every worker decoded and processed again) is
no longer accepted; any other version or shape is a :class:`PromptWireError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.image_processor import DeferredPixels, check_resized
from engine.inputs import ProcessedPrompt
from engine.sequence import MultiModalInput
from node_common.messages import MessageError

PROMPT_VERSION = 3
READABLE_VERSIONS = (2, 3)
_DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8"), "uint8": np.dtype("u1")}


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
                  "images": None, "pixels": None}
    if for_encoder:
        source = mm.pixel_values
        if isinstance(source, DeferredPixels):
            wire["mm"]["images"] = [_array(a) for a in source.uint8()]
        else:
            wire["mm"]["pixels"] = _array(mm.pixels())
    return wire


def prompt_from_wire(d: Any, image_processor: Any = None) -> ProcessedPrompt:
    """Inverse of :func:`prompt_to_wire`: the :class:`ProcessedPrompt` the engine takes as it is
    (``LLMEngine.add_request``; its pixels are None on the decode side). Resized images become pixels through
    ``image_processor`` (the worker's own, :attr:`engine.llm_engine.LLMEngine.image_processor`), when its vision tower
    first needs them. Raises :class:`PromptWireError`."""
    if not isinstance(d, dict) or d.get("v") not in READABLE_VERSIONS:
        got = d.get("v", 1) if isinstance(d, dict) else type(d).__name__
        raise PromptWireError(f"prompt wire version {got!r} is not supported (expected one of {READABLE_VERSIONS})")
    try:
        ids, text, m = d["token_ids"], d.get("text"), d.get("mm")
        if not isinstance(ids, list) or not (text is None or isinstance(text, str)):
            raise TypeError("token_ids must be a list and text a str or None")
        if m is None:
            return ProcessedPrompt(text, ids, None)
        grid = m["grid_thw"]
        grid = None if grid is None else np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        pixels = None if m["pixels"] is None else torch.from_numpy(_from_array(m["pixels"], "float32"))
        if m.get("images") is not None:
            if image_processor is None:
                raise ValueError("resized images for a worker without an image processor")
            arrays = [_from_array(a, "uint8") for a in m["images"]]
            try:
                check_resized(arrays, image_processor.resized_shapes(len(m["hashes"]), grid))
            except InvalidRequestError as e:
                raise ValueError(str(e)) from None
            pixels = DeferredPixels(image_processor, resized=arrays)
        mm = MultiModalInput(
            pixel_values=pixels,
            image_hashes=[bytes(h) for h in m["hashes"]], positions=_from_array(m["positions"], "int64"),
            tokens_per_image=int(m["tokens_per_image"]), token_counts=[int(c) for c in m["token_counts"]],
            grid_thw=grid,
            mrope=None if m["mrope"] is None else _from_array(m["mrope"], "int64"), mrope_delta=int(m["mrope_delta"]))
        return ProcessedPrompt(text, ids, mm)
    except (KeyError, TypeError, ValueError) as e:
        raise PromptWireError(f"malformed prompt: {e!r}") from None


def _array(a: np.ndarray | torch.Tensor) -> dict[str, Any]:
    x = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    name = "float32" if x.dtype.kind == "f" else "uint8" if x.dtype == np.uint8 else "int64"
    x = np.ascontiguousarray(x, dtype=_DTYPES[name])
    return {"dtype": name, "shape": list(x.shape), "data": x.tobytes()}


def _from_array(d: dict, want: str) -> np.ndarray:
    if not isinstance(d, dict) or d.get("dtype") != want:
        got = d.get("dtype") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"array dtype {got!r}, expected {want!r}")
    shape, data = [int(s) for s in d["shape"]], d["data"]
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape)) * _DTYPES[want].itemsize:
        raise ValueError(f"array data does not hold shape {shape}")
    return np.frombuffer(data, dtype=_DTYPES[want]).reshape(shape).copy()  # writable, owned by the engine
