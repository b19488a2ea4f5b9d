"""A loopback fault proxy for the gRPC KV transport: an HTTP CONNECT proxy the prefill workers' KV channels dial
through (``ClusterSpec.kv_proxy``), which forwards bytes both ways and, on command, stalls or corrupts them.

Modes (:meth:`FaultProxy.set_mode`, any time, every connection at once):

* ``forward``: bytes pass unchanged.
* ``stall``: nothing is forwarded in either direction and nothing is closed (a link that stops without breaking);
  what was read meanwhile stays buffered and flows once the mode is ``forward`` again.
* ``corrupt``: prefill -> decode bytes pass with one byte in each chunk XOR-ed (a random position), so frames arrive
  with wrong bytes (a MAC or crc32 failure, a malformed message, or a broken HTTP/2 connection: each must end typed).

Threads only (one pair of pumps per connection); every socket wait has a timeout so :meth:`close` returns promptly.
"""

from __future__ import annotations

import random
import socket
import threading
import time

MODES = ("forward", "stall", "corrupt")
_POLL_S = 0.2


class FaultProxy:
    """``FaultProxy()`` listens on 127.0.0.1 (a free port); ``address`` is "127.0.0.1:PORT". Loopback targets only."""

    def __init__(self, *, seed: int = 0) -> None:
        self._mode = "forward"
        self._cond = threading.Condition()
        self._rng = random.Random(seed)
        self._closed = False
        self._socks: set[socket.socket] = set()
        self.connections = 0
        self.corrupted_chunks = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode must be one of {MODES}, got {mode!r}")
        with self._cond:
            self._mode = mode
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)
        self._listener.close()
        self._thread.join(timeout=2)

    # -- internals -----------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        """Read the CONNECT request, dial the (loopback) target, answer 200, then pump both ways."""
        client.settimeout(5.0)
        try:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = client.recv(4096)
                if not chunk:
                    raise OSError("closed before CONNECT")
                head += chunk
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(line) < 2 or line[0] != "CONNECT":
                raise OSError(f"not a CONNECT request: {line!r}")
            host, _, port = line[1].rpartition(":")
            if host not in ("127.0.0.1", "localhost"):
                raise OSError(f"loopback targets only, got {host!r}")
            upstream = socket.create_connection((host, int(port)), timeout=5.0)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            rest = head.split(b"\r\n\r\n", 1)[1]
            if rest:
                upstream.sendall(rest)
        except (OSError, ValueError):
            _close(client)
            return
        with self._cond:
            if self._closed:
                _close(client), _close(upstream)
                return
            self._socks |= {client, upstream}
            self.connections += 1
        for src, dst, up in ((client, upstream, True), (upstream, client, False)):
            src.settimeout(_POLL_S)
            threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _gate(self) -> str | None:
        """Wait while stalled; the mode to forward under, or None once closed."""
        with self._cond:
            while self._mode == "stall" and not self._closed:
                self._cond.wait(_POLL_S)
            return None if self._closed else self._mode

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                if self._gate() is None:
                    return
                try:
                    data = src.recv(65536)
                except (TimeoutError, socket.timeout):
                    continue
                if not data:
                    return
                mode = self._gate()  # a stall that began while this chunk was read holds it too
                if mode is None:
                    return
                if mode == "corrupt" and upstream:
                    data = self._corrupt(data)
                dst.sendall(data)
        except OSError:
            return
        finally:
            _close(src), _close(dst)

    def _corrupt(self, data: bytes) -> bytes:
        buf = bytearray(data)
        with self._cond:
            i = self._rng.randrange(len(buf))
            buf[i] ^= 1 << self._rng.randrange(8)
            self.corrupted_chunks += 1
        return bytes(buf)


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


def wait_until(pred, timeout_s: float, poll_s: float = 0.1) -> float | None:
    """Poll ``pred`` until true; the seconds it took, or None at the deadline."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None
