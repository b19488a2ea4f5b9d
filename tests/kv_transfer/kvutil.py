"""Helpers shared by the KV-transfer tests and their spawned peer processes (no pytest import here).

* :func:`make_layout` / :func:`make_kv`: a small layout and deterministic per-(seed, layer) K/V tensors, so two
  processes can produce and check the same data without shipping it.
* :class:`Collector`: a thread-safe sink that records every call.
* :func:`make_manager`: a transport's manager with short test timeouts.
* :func:`wait_until`: bounded polling.
* :func:`inject_after_layer0`: frames a stranger in the middle adds to a transfer's stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
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


Extra = Callable[[dict[str, Any], torch.Tensor], list[tuple[bytes, torch.Tensor | None]]]


def inject_after_layer0(sender: Any, monkeypatch: Any, extra: Extra) -> None:
    """Right after layer 0 goes on the wire, the frames ``extra(its header, its payload)`` returns follow it
    (``(header bytes, payload or None)`` each), as a stranger in the middle of the stream would add them.
    ``sender``: a link transport's sender (its link's transmit is wrapped: the frames go from its send thread); None
    for gRPC (every Push stream started afterwards carries them; layer 0's payload must fit one message)."""
    if sender is not None:
        link = sender._link
        transmit = link._transmit

        def tx(header: bytes, payload: torch.Tensor | None) -> None:
            transmit(header, payload)
            h = msgpack.unpackb(header, raw=False)
            if h.get("kind") == "layer" and h.get("layer") == 0:
                for hb, p in extra(h, payload):
                    transmit(hb, p)

        link._transmit = tx
        return
    from kv_transfer.grpc import client as grpc_client

    original = grpc_client.Sender._messages

    def messages(self):
        pending = None
        for m in original(self):
            yield m
            if pending is not None:  # m is layer 0's payload
                for hb, p in extra(pending, torch.frombuffer(bytearray(m), dtype=torch.uint8)):
                    yield hb
                    if p is not None:
                        yield p.numpy().tobytes()
                pending = None
                continue
            try:
                h = msgpack.unpackb(m, raw=False)
            except Exception:  # noqa: BLE001 - a payload chunk
                continue
            if isinstance(h, dict) and h.get("kind") == "layer" and h.get("layer") == 0:
                pending = h

    monkeypatch.setattr(grpc_client.Sender, "_messages", messages)
