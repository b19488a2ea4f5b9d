"""The serving front-end: ``duet serve``.

Modules: :mod:`.config` (config file + flags, validated), :mod:`.limits` (caps, image header checks, admission),
:mod:`.schema` (requests and events), :mod:`.service` (the request path both APIs share), :mod:`.grpc_api`
(``duet.v1`` + health + token check), :mod:`.openai_api` and :mod:`.openai_requests` (OpenAI-compatible HTTP,
``/health``, ``/metrics``), :mod:`.metrics` (Prometheus), :mod:`.errors` (one status table for both APIs),
:mod:`.expert_load` and :mod:`.stop_strings` (pure helpers), :mod:`.server` (both listeners on one loop, drain),
:mod:`.cli` (the command).
"""

from cluster.serve.config import ServeConfig
from cluster.serve.limits import Limits
from cluster.serve.server import Server, ServerThread

__all__ = ["Limits", "ServeConfig", "Server", "ServerThread"]
