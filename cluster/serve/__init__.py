"""The serving front-end: ``duet serve``.

Modules: :mod:`.config` (config file + flags, validated), :mod:`.limits` (caps, image header checks, admission),
:mod:`.schema` (requests and events), :mod:`.service` (the request path both APIs share), :mod:`.grpc_api`
(``duet.v1`` + health + token check), :mod:`.openai_api` and :mod:`.openai_requests` (OpenAI-compatible HTTP,
``/health``, ``/metrics``), :mod:`.metrics` (Prometheus), :mod:`.errors` (one status table for both APIs),
:mod:`.expert_load` and :mod:`.stop_strings` (pure helpers), :mod:`.server` (both listeners on one loop, drain),
:mod:`.cli` (the command).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# imported on first use: `duet client` and `duet status` build the command line's parser (cluster.serve.cli's
# arguments) without the server's modules, which import torch
_EXPORTS = {"ServeConfig": "cluster.serve.config", "Limits": "cluster.serve.limits", "Server": "cluster.serve.server",
            "ServerThread": "cluster.serve.server"}
__all__ = ["Limits", "ServeConfig", "Server", "ServerThread"]

if TYPE_CHECKING:
    from cluster.serve.config import ServeConfig
    from cluster.serve.limits import Limits
    from cluster.serve.server import Server, ServerThread


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
