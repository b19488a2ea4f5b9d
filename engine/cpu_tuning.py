"""Process-level tuning for CPU inference.

glibc serves large allocations (above a dynamic threshold that starts at 128 KiB) with fresh ``mmap`` pages and
returns them on free, so every activation tensor of a big prefill pays page faults and zeroing in the kernel; on a
2-core machine that made element-wise ops 5-10x slower than their memory bandwidth allows. Raising the mmap and trim
thresholds keeps freed blocks in the heap for reuse (the effect of ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``, or of preloading tcmalloc/jemalloc as CPU serving stacks recommend). It applies to the
whole process, so a baseline measured in the same process benefits equally.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 2**31 - 1  # glibc caps the value it accepts (HEAP_MAX on 64-bit is larger; int arg)
_applied = False


def tune_malloc() -> bool:
    """Raise glibc's mmap/trim thresholds once per process. Returns True if applied (no-op off glibc)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TOP_PAD, 256 << 20)))
    _applied = ok
    if not ok:
        logger.debug("mallopt rejected a setting; keeping glibc defaults")
    return ok
