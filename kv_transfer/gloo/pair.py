"""One (prefill worker, decode worker) pair: a process group of two ranks used as a bidirectional frame link.

Wire format of a frame (same in both directions, tag 0): ``int64[2] = (header_len, payload_len)``, then the
msgpack header as a uint8 tensor, then (when ``payload_len > 0``) the payload as a uint8 tensor. The preamble and
header use the gloo control group; the payload uses the data group (the same gloo group, or NCCL with CUDA
payloads). The send thread (see :class:`kv_transfer.link.Link`) pings when idle, so the receive thread's blocking
``recv`` (bounded by the group timeout) never times out on a healthy idle pair; a peer that dies breaks the TCP
connection and the pending ``recv`` fails at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from kv_transfer.auth import LinkAuth
from kv_transfer.base import PeerUnavailable
from kv_transfer.link import Link, LinkState
from kv_transfer.routing import Dispatcher

log = logging.getLogger(__name__)
TAG = 0
MAX_HEADER_BYTES = 64 << 20
MAX_PAYLOAD_BYTES = 1 << 40

GroupsFactory = Callable[[], tuple[dist.ProcessGroup, dist.ProcessGroup]]


class Pair(Link):
    """``rank`` 0 is the decode side, 1 the prefill side. ``connect`` builds (control, data) groups (bounded).
    ``auth``: the pair's :class:`LinkAuth` (keyed by its ``pair_key``, sides named by rank), None with auth off."""

    def __init__(self, *, dispatcher: Dispatcher, rank: int, connect: GroupsFactory, keepalive_s: float,
                 payload_device: torch.device, name: str, on_closed: Callable[[Pair], None],
                 auth: LinkAuth | None = None) -> None:
        super().__init__(dispatcher=dispatcher, keepalive_s=keepalive_s, name=name, auth=auth)
        self.rank, self._peer = rank, 1 - rank
        self._connect_fn, self._on_closed_cb = connect, on_closed
        self._payload_device = payload_device
        self._ctl: dist.ProcessGroup | None = None
        self._data: dist.ProcessGroup | None = None
        self._recv_thread = threading.Thread(target=self._recv_loop, name=f"kv-recv-{name}", daemon=True)

    def _connect(self) -> None:
        self._ctl, self._data = self._connect_fn()
        self._recv_thread.start()

    def _transmit(self, header: bytes, payload: torch.Tensor | None) -> None:
        nbytes = 0 if payload is None else payload.numel()
        self._send(self._ctl, torch.tensor([len(header), nbytes], dtype=torch.int64))
        self._send(self._ctl, torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if nbytes:
            self._send(self._data, payload)

    def _recv_loop(self) -> None:
        try:
            while True:
                pre = self._recv(self._ctl, torch.empty(2, dtype=torch.int64))
                header_len, payload_len = pre.tolist()
                if not (0 < header_len <= MAX_HEADER_BYTES and 0 <= payload_len <= MAX_PAYLOAD_BYTES):
                    raise PeerUnavailable(f"pair {self.name}: garbled preamble {pre.tolist()}")
                if payload_len > self.dispatcher.max_payload_bytes:  # before allocating it, whoever the peer is
                    raise PeerUnavailable(f"pair {self.name}: a frame announces {payload_len} payload bytes; no lease "
                                          f"issued here allows more than {self.dispatcher.max_payload_bytes}")
                header = self._recv(self._ctl, torch.empty(header_len, dtype=torch.uint8)).numpy().tobytes()
                payload = None
                if payload_len:
                    payload = self._recv(self._data, torch.empty(payload_len, dtype=torch.uint8,
                                                                 device=self._payload_device))
                if not self.on_frame(header, payload):
                    break  # the peer said bye: nothing more will come
            self._send_thread.join(timeout=2.0)
            self.die(PeerUnavailable(f"peer closed pair {self.name}"))
        except Exception as e:  # noqa: BLE001 - a thread boundary: any wire error ends the pair
            level = logging.DEBUG if self.state >= LinkState.CLOSING else logging.WARNING
            log.log(level, "pair %s: receive failed: %s", self.name, e)
            self.die(e if isinstance(e, PeerUnavailable) else PeerUnavailable(f"pair {self.name}: {e}"))

    def _join_receive(self, timeout_s: float) -> None:
        if self._recv_thread.is_alive():
            self._recv_thread.join(timeout_s)

    def _on_closed(self) -> None:
        self._on_closed_cb(self)

    def _send(self, group: dist.ProcessGroup, t: torch.Tensor) -> None:
        group.send([t], self._peer, TAG).wait()
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def _recv(self, group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
        group.recv([t], self._peer, TAG).wait()
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        return t
