"""Kernel choices measured at load, kept per host so the next process on it reads them instead of timing again.

Each CPU kernel choice (:mod:`engine.cpu_linear`'s linear timings and tiled-GEMM row count, the MoE paths, the
one-call layer's batch limit, the compiled prefill attention's threshold) is measured once per process and kept in
a module-level table. :func:`remembered` puts the same answers in one JSON file per host (``~/.cache/duet/tuning``,
or ``$XDG_CACHE_HOME/duet/tuning``; ``DUET_TUNING_CACHE`` names another directory, or ``off``), so that:

* the second worker of a node, which waits for the first's tuning turn (:func:`engine.cpu_linear.tuning_turn`),
  takes the first's measurements instead of timing the same shapes again (a 2-core host's ``duet serve`` loads a
  prefill and a decode worker; about a second of tuning each for the demo model);
* a restarted worker (a dead worker is a normal event) comes back without the probes, and with the choices the
  node's other workers run.

What one entry depends on is in its key (shapes, dtype, threads) or in the file's name: the CPU (model name and
flags), torch's version, the source of the compiled kernels and of the modules that probe them (a changed probe
never reads an old answer), and :data:`CACHE_VERSION`. An entry older than
:data:`MAX_AGE_S` is measured again (a host's speed drifts; one noisy measurement is not kept for ever). The file is
written whole to a temporary file and renamed over the old one, merging what another process wrote meanwhile; a
file that cannot be read or parsed counts as empty, one that cannot be written is skipped: the cache never fails a
load, it only saves time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.cpu_kernels as cpu_kernels

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # the file's format (a changed probe is caught by the source hash in the file's name)
MAX_AGE_S = 12 * 3600.0
ENV = "DUET_TUNING_CACHE"

_lock = threading.Lock()
_entries: dict[str, dict[str, list]] | None = None  # table -> repr(key) -> [value, measured at (unix s)]
_new: dict[str, dict[str, list]] = {}  # what this process measured since its last save


def cache_path() -> Path | None:
    """This host's file, or None when the cache is off."""
    where = os.environ.get(ENV, "")
    if where.lower() == "off":
        return None
    try:
        if where:
            base = Path(where)
        else:
            xdg = os.environ.get("XDG_CACHE_HOME")
            base = (Path(xdg) if xdg else Path.home() / ".cache") / "duet" / "tuning"
        return base / f"tuning_{_host_key()}.json"
    except (OSError, RuntimeError) as e:  # no home directory, an unreadable source file: no cache, never a failed load
        logger.debug("tuning cache off: %s", e)
        return None


@functools.lru_cache(maxsize=1)
def _host_key() -> str:
    here = Path(__file__).parent  # the kernels, and the modules whose probes give the answers
    probes = [here / f for f in ("cpu_linear.py", "moe.py", "text_model.py", "attention.py", "tuning_cache.py")]
    sources = b"".join(p.read_bytes() for p in (*cpu_kernels.SOURCES, cpu_kernels.HEADER, *probes) if p.exists())
    parts = [str(CACHE_VERSION), torch.__version__, cpu_kernels._cpu_signature(), hashlib.sha256(sources).hexdigest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _read(path: Path) -> dict[str, dict[str, list]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or not isinstance(doc.get("tables"), dict):
        return {}
    return {name: dict(t) for name, t in doc["tables"].items() if isinstance(t, dict)}


def _tuples(value: Any) -> Any:
    """JSON's lists back into the tuples the tables hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def refresh() -> None:
    """Read the file again (call after taking the tuning turn: the process before may have just written it)."""
    global _entries
    path = cache_path()
    with _lock:
        _entries = _read(path) if path is not None else {}


def _shaped_like(value: Any, like: Any) -> bool:
    """Does ``value`` have ``like``'s structure: tuples of the same lengths, bools where it has bools, other numbers
    where it has numbers?"""
    if isinstance(like, tuple):
        return isinstance(value, tuple) and len(value) == len(like) and all(map(_shaped_like, value, like))
    if isinstance(like, bool):
        return isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def remembered(table: dict, name: str, key: tuple, measure: Callable[[], Any], like: Any) -> Any:
    """``table[key]``, else this host's cached answer for (``name``, ``key``) if younger than :data:`MAX_AGE_S` and
    shaped ``like`` the answers ``measure`` gives (an example: numbers, booleans and nested tuples of them), else
    ``measure()`` (recorded for :func:`save`)."""
    if key in table:
        return table[key]
    if _entries is None:
        refresh()
    entry = _entries.get(name, {}).get(repr(key)) if _entries is not None else None
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], (int, float)) \
            and 0 <= time.time() - entry[1] < MAX_AGE_S and _shaped_like(_tuples(entry[0]), like):
        table[key] = _tuples(entry[0])
        return table[key]
    value = measure()
    table[key] = value
    if os.environ.get(ENV, "").lower() != "off":  # kept for save()
        with _lock:
            _new.setdefault(name, {})[repr(key)] = [value, time.time()]
    return value


def save() -> bool:
    """Merge what this process measured into the host's file (atomically). Returns whether it was written."""
    path = cache_path()
    with _lock:
        if path is None or not _new:
            return False
        tables = _read(path)
        for name, items in _new.items():
            tables.setdefault(name, {}).update(items)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "tables": tables}, f)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as e:
            logger.debug("tuning cache %s not written: %s", path, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        if _entries is not None:
            for name, items in _new.items():
                _entries.setdefault(name, {}).update(items)
        _new.clear()
        return True
