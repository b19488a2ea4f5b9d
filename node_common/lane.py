"""A worker's fast lane to its front-end: a loopback socket for what a request waits on, beside Ray's control plane.

A Ray actor call costs about 1 ms each way on a small host (2 cores, round trip 1.06 ms against 0.07 ms on a
loopback socket, same payload), and a served text prompt crosses that twice before its first token is on the wire:
the request into the decode worker, the first token back out. Where the front-end and the worker share a node, the
worker opens a :class:`LaneServer` on ``127.0.0.1`` and the front-end connects to it; everything else (allocation,
stats, reset, shutdown) stays on Ray.

Wire: each frame is a 4-byte little-endian length and a msgpack map (:mod:`node_common.messages`, versioned) of
``kind``, ``id`` and ``body`` (bytes: the same messages the Ray methods take and return). The client's first frame is
``hello`` with a body of ``{token, epoch, poll_s, coalesce_s}``; a connection whose hello is late, malformed or has
the wrong token is closed with nothing done. After it the server pushes ``events`` frames (each one a poll reply,
``{"events": [...], "free_blocks": n}``; an empty one at least every ``poll_s`` while idle) and answers each ``call``
frame (``body``: ``{method, msg}``) with a ``reply`` frame of the same ``id``. A frame over :data:`MAX_FRAME` bytes
closes the connection. The token is made by the worker and reaches the front-end over Ray, like the cluster's
data-plane key.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable

from engine.errors import InvalidRequestError
from node_common import messages

logger = logging.getLogger(__name__)

MAX_FRAME = 64 << 20  # a frame this large is a broken or hostile peer
HELLO_TIMEOUT_S = 5.0  # a connection must say hello (with the token) this soon
_HEADER = struct.Struct("<I")


class LaneClosed(ConnectionError):
    """The lane's connection ended (the peer closed it, or a frame was malformed or too large)."""


def frame(kind: str, body: bytes, id_: int = 0) -> bytes:
    """One frame on the wire (header and payload)."""
    payload = messages.pack(kind=kind, id=id_, body=body)
    return _HEADER.pack(len(payload)) + payload


def parse(payload: bytes) -> tuple[str, int, bytes]:
    """A frame's payload -> (kind, id, body); :class:`LaneClosed` for a malformed one."""
    try:
        m = messages.unpack(payload)
        kind, id_, body = m["kind"], m["id"], m["body"]
    except (messages.MessageError, KeyError, TypeError, ValueError) as e:
        raise LaneClosed(f"malformed lane frame: {e}") from None
    if not isinstance(kind, str) or not isinstance(id_, int) or not isinstance(body, bytes):
        raise LaneClosed("malformed lane frame: wrong field types")
    return kind, id_, body


def frame_length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise LaneClosed(f"lane frame of {n} bytes is over the limit ({MAX_FRAME})")
    return n


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) < n:
        raise LaneClosed("the peer closed the lane")
    return data


def read_frame(f) -> tuple[str, int, bytes]:
    """The next frame from a blocking binary file over the socket."""
    return parse(_read_exactly(f, frame_length(_read_exactly(f, _HEADER.size))))


class LaneServer:
    """The worker's side: a listening socket on ``host`` (loopback unless told), a thread per connection.

    ``events(hello)``: blocks until there is something to push (or ``hello["poll_s"]`` passed) and returns a poll
    reply, or None once this connection should end (its front-end generation is over, the worker stopped).
    ``calls``: method name -> ``handler(msg) -> reply``; an unknown method gets an error reply."""

    def __init__(self, events: Callable[[dict], bytes | None], calls: dict[str, Callable[[bytes], bytes]],
                 host: str = "127.0.0.1") -> None:
        self.events, self.calls = events, calls
        self.token = secrets.token_bytes(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(8)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="lane-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in [self._sock, *conns]:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        done = threading.Event()

        def send(data: bytes) -> None:
            with send_lock:
                conn.sendall(data)

        try:
            f = conn.makefile("rb")
            conn.settimeout(HELLO_TIMEOUT_S)
            kind, _, body = read_frame(f)
            hello = messages.unpack(body) if kind == "hello" else {}
            token = hello.get("token")
            if not isinstance(token, bytes) or not hmac.compare_digest(token, self.token):
                logger.warning("lane connection refused: no valid token in its hello")
                return
            conn.settimeout(None)
            pusher = threading.Thread(target=self._push, args=(hello, send, done, conn), name="lane-push", daemon=True)
            pusher.start()
            while not done.is_set():
                kind, id_, body = read_frame(f)
                if kind != "call":
                    raise LaneClosed(f"unexpected lane frame {kind!r}")
                send(frame("reply", self._call(body), id_))
        except (OSError, LaneClosed, messages.MessageError, KeyError, TypeError, ValueError) as e:
            if not self._closed and not done.is_set():
                logger.info("lane connection ended: %s", e)
        finally:
            done.set()
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _call(self, body: bytes) -> bytes:
        try:
            m = messages.unpack(body)
            handler = self.calls.get(m["method"])
            if handler is None:
                raise InvalidRequestError(f"no lane method {m['method']!r}")
            return handler(m["msg"])
        except messages.REPLY_ERRORS as e:
            return messages.error_reply(e)

    def _push(self, hello: dict, send: Callable[[bytes], None], done: threading.Event, conn: socket.socket) -> None:
        try:
            while not done.is_set() and not self._closed:
                reply = self.events(hello)
                if reply is None:
                    break
                send(frame("events", reply))
        except OSError:  # the front-end went away
            pass
        except (TypeError, ValueError) as e:  # a hello whose fields the worker could not use
            logger.warning("lane closed: %s", e)
        finally:  # pushing ended, so does the connection: the front-end reads that as the worker gone
            done.set()
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the reader thread, which closes it
            except OSError:
                pass
