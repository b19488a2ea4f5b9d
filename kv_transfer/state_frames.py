"""State frames: a request's per-layer recurrent state (hybrid models' GDN layers), moved as named raw tensors.

A lease with a :class:`~kv_transfer.base.StateLayout` expects ``num_frames`` state frames beside its KV layers, frame
``i`` carrying one tensor per :class:`~kv_transfer.base.TensorSpec` of the layout (for Qwen3.5: a conv window and a
recurrent matrix per GDN layer). This layer never interprets them: it checks names, shapes and dtypes against the
lease, and their bytes against a crc32.

Header (beside the frame fields of :mod:`kv_transfer.frames`)::

    {"kind": "state", "request_id", "index": i, "format": STATE_FORMAT,
     "tensors": [[name, dtype, [shape...], nbytes], ...], "nbytes": total, "crc32": crc of the payload}

Payload: the tensors' bytes, in the header's order, each C-contiguous in its own dtype. State always travels raw,
whatever the request's compression policy (KV compression never touches it: quantizing a recurrent state compounds
its error over every later token, and no measurement says any cheaper format keeps greedy agreement). A header of
another ``format`` is a :class:`~kv_transfer.base.ProtocolError`; a bad crc a
:class:`~kv_transfer.base.ChecksumMismatch` (the frame never reaches the state sink).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from kv_transfer.errors import ChecksumMismatch, ProtocolError
from kv_transfer.layout import DTYPES, StateLayout

STATE_FORMAT = 1


def _crc(payload: torch.Tensor) -> int:
    return zlib.crc32(memoryview(payload.numpy())) if payload.numel() else 0


def encode_state(request_id: str, index: int, tensors: dict[str, torch.Tensor], layout: StateLayout,
                 ) -> tuple[dict[str, Any], torch.Tensor]:
    """(header, uint8 CPU payload) for state frame ``index``. Raises ``ValueError`` when ``tensors`` do not match
    the layout's specs (names, shapes, dtypes)."""
    if not 0 <= index < layout.num_frames:
        raise ValueError(f"state frame {index} out of range [0, {layout.num_frames})")
    if sorted(tensors) != sorted(s.name for s in layout.tensors):
        raise ValueError(f"state frame tensors {sorted(tensors)}; the lease needs {[s.name for s in layout.tensors]}")
    parts, entries = [], []
    for spec in layout.tensors:
        t = tensors[spec.name]
        if tuple(t.shape) != spec.shape or t.dtype != DTYPES[spec.dtype]:
            raise ValueError(f"state tensor {spec.name} is {tuple(t.shape)} {t.dtype}; the lease needs {spec.shape} "
                             f"{spec.dtype}")
        raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        entries.append([spec.name, spec.dtype, list(spec.shape), raw.numel()])
    payload = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    header = {"request_id": request_id, "index": index, "format": STATE_FORMAT, "tensors": entries,
              "nbytes": payload.numel(), "crc32": _crc(payload)}
    return header, payload


def decode_state(header: dict[str, Any], payload: torch.Tensor | None, layout: StateLayout,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Verify and split a state frame: ``{name: tensor}`` (on ``device``, default CPU). Raises
    :class:`ProtocolError` (format, layout) or :class:`ChecksumMismatch` (bytes)."""
    if header.get("format") != STATE_FORMAT:
        raise ProtocolError(f"state frame format {header.get('format')!r} is not supported (expected {STATE_FORMAT})")
    want = [[s.name, s.dtype, list(s.shape), s.nbytes] for s in layout.tensors]
    if header.get("tensors") != want:
        raise ProtocolError(f"state frame tensors {header.get('tensors')!r} do not match the lease's {want}")
    size = 0 if payload is None else payload.numel()
    if size != header.get("nbytes") or size != layout.frame_nbytes:
        raise ProtocolError(f"state frame carries {size} bytes; header says {header.get('nbytes')}, the lease "
                            f"{layout.frame_nbytes}")
    payload = payload.to("cpu") if payload.is_cuda else payload
    if _crc(payload) != header.get("crc32"):
        raise ChecksumMismatch(f"request {header.get('request_id')!r}: state frame {header.get('index')} failed its "
                               "crc32")
    out, start = {}, 0
    for spec in layout.tensors:
        chunk = payload[start:start + spec.nbytes].clone()
        out[spec.name] = chunk.view(DTYPES[spec.dtype]).view(spec.shape).to(device or "cpu")
        start += spec.nbytes
    return out
