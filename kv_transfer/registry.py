"""Transport registry: ``get_manager_class(name)`` for the names a lease's ``transport`` field may hold.

Transports are imported on first use, so a process that never uses gRPC never imports it.
"""

from __future__ import annotations

import importlib

from kv_transfer.base import KVManager

_TRANSPORTS: dict[str, tuple[str, str]] = {
    "inproc": ("kv_transfer.inproc", "Manager"),
    "gloo": ("kv_transfer.gloo", "Manager"),
    "nccl": ("kv_transfer.gloo", "NcclManager"),
    "grpc": ("kv_transfer.grpc", "Manager"),
}
TRANSPORTS: tuple[str, ...] = tuple(_TRANSPORTS)


def get_manager_class(name: str) -> type[KVManager]:
    """The manager class of transport ``name`` (one of :data:`TRANSPORTS`); ``ValueError`` for other names.

    Constructing the class may still raise :class:`PeerUnavailable` when the host cannot run it (``"nccl"``
    without CUDA), and raises :class:`~kv_transfer.auth.MissingSecret` for a transport that crosses processes given
    neither ``secret=`` nor the explicit ``insecure=True``.
    """
    try:
        module, attr = _TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r} (known: {', '.join(TRANSPORTS)})") from None
    return getattr(importlib.import_module(module), attr)
