"""Helpers shared by the KV-transfer tests and their spawned peer processes (no pytest import here).

* :func:`make_layout` / :func:`make_kv`: a small layout and deterministic per-(seed, layer) K/V tensors, so two
  processes can produce and check the same data without shipping it.
* :class:`Collector`: a thread-safe sink that records every call.
* :func:`make_manager`: a transport's manager with short test timeouts.
* :func:`wait_until`: bounded polling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kv_transfer import ClusterSecret, KVLayout, KVManager, get_manager_class

TRANSPORTS = ["inproc", "gloo", "grpc"]
PROCESS_TRANSPORTS = ["gloo", "grpc"]
MANAGER_KWARGS: dict[str, dict] = {"gloo": {"op_timeout_s": 10.0, "keepalive_s": 0.5, "connect_timeout_s": 2.0}}


# every test manager authenticates the data plane with this secret (spawned peers import the same value)
TEST_SECRET = ClusterSecret(b"duet-kv-tests-shared-secret-0123")


def make_manager(transport: str, **kwargs) -> KVManager:
    return get_manager_class(transport)(**{**MANAGER_KWARGS.get(transport, {}), "secret": TEST_SECRET, **kwargs})


def make_layout(dtype: str = "float32", num_layers: int = 4) -> KVLayout:
    return KVLayout(num_layers=num_layers, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)


def make_kv(layout: KVLayout, num_blocks: int, *, seed: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K, V ``[num_blocks, block_size, kv_heads, head_dim]`` in the layout's dtype."""
    g = torch.Generator().manual_seed(seed * 1009 + layer)
    shape = layout.block_shape(num_blocks)
    k = torch.randn(shape, generator=g).to(layout.torch_dtype)
    v = torch.randn(shape, generator=g).to(layout.torch_dtype)
    return k, v


class Collector:
    """A sink: ``layers[layer] = (k, v)`` (copies) and ``calls`` in call order."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self._lock:
            self.calls.append(layer)
            self.layers[layer] = (k.clone(), v.clone())

    def matches(self, layout: KVLayout, num_blocks: int, *, seed: int) -> bool:
        """Every layer arrived once and equals :func:`make_kv` bit for bit."""
        if sorted(self.calls) != list(range(layout.num_layers)):
            return False
        for layer, (k, v) in self.layers.items():
            ek, ev = make_kv(layout, num_blocks, seed=seed, layer=layer)
            if k.dtype != ek.dtype or not (torch.equal(k, ek) and torch.equal(v, ev)):
                return False
        return True


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
