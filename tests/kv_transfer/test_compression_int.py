"""The vectorised ``int`` compression kernel against a per-group loop that reads the byte layout
:mod:`kv_transfer.compression_int` documents, and within the method's error bound."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import compression_int
from tests.kv_transfer.test_compression import int_bound


def reference_int_decode(blob: torch.Tensor, n: int, flat: int, bits: int, group: int, keys: bool,
                         scale_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize an ``int`` entry one group at a time, reading the byte layout the module docstring states."""
    rows, cols = (n, flat) if keys else (flat, n)
    groups = -(-rows // group)
    size = groups * cols * scale_dtype.itemsize
    scale = blob[:size].clone().view(scale_dtype).float().view(groups, cols)
    mn = blob[size:2 * size].clone().view(scale_dtype).float().view(groups, cols)
    raw = blob[2 * size:]
    codes = torch.stack([raw & 0xF, raw >> 4], 1).flatten()[:n * flat] if bits == 4 else raw
    mat = codes.view(n, flat).float()
    mat = mat if keys else mat.t()
    out = torch.empty_like(mat)
    for gi in range(groups):
        rs = slice(gi * group, (gi + 1) * group)
        out[rs] = mn[gi] + mat[rs] * scale[gi]
    return out if keys else out.t()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [1, 7, 16, 64])
@pytest.mark.parametrize("keys", [True, False], ids=["keys", "values"])
@pytest.mark.parametrize("magnitude", [1.0, 1e6], ids=["float16-scales", "float32-scales"])
def test_vectorised_int_kernel_matches_a_per_group_reference(bits: int, group: int, keys: bool,
                                                             magnitude: float) -> None:
    g = torch.Generator().manual_seed(bits * group)
    n, kvh, c = 37, 2, 24
    x = (torch.randn(n, kvh, c, generator=g) + torch.randn(kvh, c, generator=g) * 3) * magnitude
    stats = compression_int.int_params(x.reshape(n, -1), bits, group, keys)
    scale_dtype = stats.dtype_name
    assert scale_dtype == ("float16" if magnitude == 1.0 else "float32")
    enc = compression_int.Encoding("int", bits, group, scale_dtype, keys)
    blob = torch.empty(enc.nbytes(n, kvh, c, 4), dtype=torch.uint8)
    compression_int.encode_int_into(x.reshape(n, -1), stats, bits, group, keys, blob)
    ref = reference_int_decode(blob, n, kvh * c, bits, group, keys, compression_int.SCALE_DTYPES[scale_dtype])
    got = enc.decode(blob, n, kvh, c, torch.float32).reshape(n, -1)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6 * magnitude)
    bound = int_bound(x, bits, group, keys).reshape(n, -1)
    assert torch.all((ref - x.reshape(n, -1)).abs() <= bound + 2 ** -24 * (x.abs().reshape(n, -1) + bound))
