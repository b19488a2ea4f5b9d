"""The KV-transfer contract: poll states, typed errors, the lease, and the sender / receiver / manager interfaces.

Who calls what:

* The DECODE side owns the lease. It allocates blocks for a request, builds a :class:`Lease` (``manager.lease(...)``),
  calls ``manager.expect(lease, sink)`` and only then hands ``lease.to_dict()`` to the prefill side (through Ray).
* The PREFILL side calls ``manager.sender(lease)`` once per request, ``send_layer`` once per layer as each layer's KV
  is ready (any order), then ``finish(meta)`` once. It learns the outcome by ``poll()`` / ``wait()``.
* Either side may ``abort(reason)`` at any time; the other side ends FAILED with :class:`TransferAborted` promptly.
* Every transfer ends FAILED with :class:`TransferTimeout` at the latest when ``lease.deadline_s`` passes.

This module imports torch only for dtype names; it never imports the model.
"""

from __future__ import annotations

import abc
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

    from kv_transfer.codec import Codec
    from kv_transfer.compression import CodecContext

LEASE_VERSION = 2  # 2 adds "state" (hybrid models' state frames); version-1 leases (no state) still parse

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Sink = Callable[..., None]
"""``sink(layer, k, v)``: k, v are ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the layout's dtype.

When the sender dropped tokens (a compression policy with ``keep_visual_tokens < 1``) the call is
``sink(layer, k, v, dropped=positions)``: ``positions`` is a sorted ``LongTensor`` (on k's device) of token
positions (``block * block_size + offset``) whose K/V did not travel (their rows are zero; the decode side must
mask them out of attention). Channels a policy pruned also arrive as zeros. Without dropped tokens the call is exactly
``sink(layer, k, v)``, so three-argument sinks keep working as long as no policy drops tokens.
"""


class KVPoll(IntEnum):
    """Where a transfer stands. Ordered: a transfer only moves forward; FAILED and SUCCESS are terminal."""

    FAILED = 0
    BOOTSTRAPPING = 1  # the connection to the peer is being set up
    WAITING = 2  # connected; no layer has moved yet
    TRANSFERRING = 3  # at least one layer has moved
    SUCCESS = 4  # sender: the receiver verified everything; receiver: every layer and the final frame arrived


class TransferError(Exception):
    """Base of every error a transfer ends with (``failure_exception()``)."""


class TransferTimeout(TransferError):
    """The lease deadline passed before the transfer succeeded."""


class TransferAborted(TransferError):
    """One side called ``abort()`` (or closed its manager), or the receiver side had no such transfer."""


class ChecksumMismatch(TransferError):
    """A block's bytes did not match the crc32 in its frame header; the layer was not handed to the sink."""


class MissingLayer(TransferError):
    """The final frame arrived before every layer had."""


class PeerUnavailable(TransferError):
    """The peer could not be reached, went away mid-transfer, or the transport cannot run on this host."""


class ProtocolError(TransferError):
    """A frame or message was malformed, had an unknown version, or did not match the lease."""


class Unauthenticated(ProtocolError):
    """A peer or frame without the lease's proof (a stranger, a forged or missing MAC): refused, counted, and the
    transfer it named goes on (:mod:`kv_transfer.auth`)."""


class FrameReplayed(Unauthenticated):
    """An authentic frame whose sequence number was already accepted for its lease (a replay)."""


class LeaseMismatch(Unauthenticated):
    """A frame bound to another lease than the transfer it was addressed to."""


ERRORS: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (TransferError, TransferTimeout, TransferAborted, ChecksumMismatch, MissingLayer, PeerUnavailable,
                ProtocolError, Unauthenticated, FrameReplayed, LeaseMismatch)
}


def error_from_name(name: str | None, message: str) -> TransferError:
    """The error a peer reported by class name (unknown names become plain :class:`TransferError`)."""
    return ERRORS.get(name or "", TransferError)(message)


def transfer_deadline(num_bytes: int, *, base_s: float = 5.0, min_rate_bps: float = 50e6) -> float:
    """Absolute deadline (``time.time()`` seconds) for moving ``num_bytes``: ``now + base_s + num_bytes / rate``.

    ``min_rate_bps`` is the slowest rate in BYTES per second the caller still considers healthy.
    """
    assert num_bytes >= 0 and base_s >= 0 and min_rate_bps > 0
    return time.time() + base_s + num_bytes / min_rate_bps


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's KV for one block: K and V are each ``[block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of K (and of V) for ``num_blocks`` blocks of one layer."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of K plus V for ``num_blocks`` blocks of one layer, uncompressed."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * math.prod(self.block_shape(num_blocks)) * itemsize

    def transfer_nbytes(self, num_blocks: int) -> int:
        """Bytes of every layer's K and V for ``num_blocks`` blocks, uncompressed."""
        return self.num_layers * self.layer_nbytes(num_blocks)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a state frame: its shape and dtype name (a key of :data:`DTYPES`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if not self.name or not isinstance(self.name, str) or any(x <= 0 for x in self.shape):
            raise ValueError(f"TensorSpec needs a name and a positive shape, got {self.name!r} {self.shape}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TensorSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass(frozen=True)
class StateLayout:
    """Per-request state that travels beside the KV (hybrid models): ``num_frames`` state frames, each holding one
    tensor per spec (:mod:`kv_transfer.state_frames`)."""

    num_frames: int
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        specs = tuple(s if isinstance(s, TensorSpec) else TensorSpec(**s) for s in self.tensors)
        object.__setattr__(self, "tensors", specs)
        if not isinstance(self.num_frames, int) or self.num_frames <= 0 or not specs:
            raise ValueError(f"StateLayout needs num_frames > 0 and tensors, got {self.num_frames!r}, {specs}")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("StateLayout tensor names must be distinct")

    @property
    def frame_nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors)

    @property
    def transfer_nbytes(self) -> int:
        return self.num_frames * self.frame_nbytes


@dataclass(frozen=True)
class Lease:
    """The decode side's promise: blocks are reserved for ``request_id`` until ``deadline_s`` (absolute wall time).

    Crosses processes as ``to_dict()`` (msgpack-able, with a ``"version"`` field). ``lease_id`` is fresh per lease
    (public): with the cluster secret it derives the lease's one-time token (:mod:`kv_transfer.auth`).
    """

    request_id: str
    num_blocks: int
    layout: KVLayout
    transport: str
    endpoint: str
    deadline_s: float
    lease_id: str = field(default_factory=lambda: secrets.token_hex(16))
    state: StateLayout | None = None  # state frames expected beside the KV (None: KV only)

    def __post_init__(self) -> None:
        if not self.request_id or not isinstance(self.request_id, str):
            raise ValueError(f"Lease.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"Lease.num_blocks must be a positive int, got {self.num_blocks!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"version": LEASE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        """Inverse of :meth:`to_dict`; raises :class:`ProtocolError` for an unknown version or a malformed dict."""
        if not isinstance(d, dict) or d.get("version") not in (1, LEASE_VERSION):
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ProtocolError(f"lease version {got!r} is not supported (expected <= {LEASE_VERSION})")
        try:
            fields = {k: v for k, v in d.items() if k != "version"}
            state = fields.get("state")
            if state is not None:
                state = StateLayout(**state)
            return cls(**{**fields, "layout": KVLayout(**fields["layout"]), "state": state})
        except (TypeError, KeyError, ValueError) as e:
            raise ProtocolError(f"malformed lease: {e}") from e


class KVSender(abc.ABC):
    """Prefill side of one request's transfer. Made by ``KVManager.sender(lease)``; used from one thread.

    * ``send_layer(layer, k, v, ctx=None)``: once per layer, any order. Non-blocking: copies ``k``/``v`` and the
      context's tensors (so the caller may reuse its buffers as soon as it returns) and enqueues; encoding,
      checksums and I/O run on a transport thread. ``ctx`` (:class:`~kv_transfer.compression.CodecContext`: valid
      tokens, which are visual, importance scores) is for compressing codecs; the identity codec ignores it.
      Raises ``ValueError`` for a wrong shape/dtype, a context that does not fit, a layer out of range or sent
      twice, or a call after ``finish``. After the transfer FAILED it drops the layer silently (check ``poll()``).
    * ``finish(meta)``: once, after the layers; ``meta`` is a msgpack-able dict (first token, expert histogram...)
      delivered to the receiver's ``meta``. A layer never sent makes both sides fail with :class:`MissingLayer`.
    * ``send_state(index, tensors)``: leases with a :class:`StateLayout` only, once per state frame, any order,
      before ``finish``; ``tensors`` maps each spec's name to a tensor of its shape and dtype. Copies them and
      enqueues, as ``send_layer``; raises ``ValueError`` likewise. Always sent raw (:mod:`kv_transfer.state_frames`).
    * SUCCESS means the receiver verified every layer, every state frame and the final frame.
    """

    tamper: Callable[[dict, torch.Tensor], None] | None = None
    """Fault injection for tests: called with each layer frame's header and uint8 payload after the checksums were
    computed and before it is sent; may mutate both in place."""

    lease: Lease

    @abc.abstractmethod
    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: CodecContext | None = None) -> None: ...

    @abc.abstractmethod
    def send_state(self, index: int, tensors: dict[str, torch.Tensor]) -> None: ...

    @abc.abstractmethod
    def finish(self, meta: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> KVPoll:
        """Block until SUCCESS or FAILED or ``timeout_s`` passed; returns the state then."""

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """End FAILED with :class:`TransferAborted` (no-op when already terminal) and tell the peer."""

    @abc.abstractmethod
    def failure_exception(self) -> TransferError | None: ...


class KVReceiver(abc.ABC):
    """Decode side of one request's transfer. Made by ``KVManager.expect(lease, sink)``.

    The sink (see :data:`Sink`) is called on a transport thread, once per verified layer, in arrival order; it must
    copy the tensors into the pool quickly (it holds up its link meanwhile). It is never called for a layer whose
    checksum failed, and never again once ``abort()`` returned or the transfer failed. SUCCESS: every layer arrived
    exactly once, verified, and the final frame arrived; ``meta`` then holds the sender's ``finish`` dict. Until the
    receiver is terminal the decode side owns its blocks but must not read them.

    State frames (leases with a :class:`StateLayout`) go to ``state_sink(index, tensors)`` under the same rules; the
    decode side sets it right after ``expect`` returns, before it hands out the lease. SUCCESS then also needs every
    state frame.
    """

    lease: Lease
    state_sink: Callable[[int, dict[str, torch.Tensor]], None] | None = None

    @property
    @abc.abstractmethod
    def meta(self) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> KVPoll: ...

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None: ...

    @abc.abstractmethod
    def failure_exception(self) -> TransferError | None: ...


class KVManager(abc.ABC):
    """One per worker per transport: owns connections, servers and threads. Thread-safe.

    Backend differences are the class attributes below; callers never branch on ``name``.
    """

    name: ClassVar[str]
    supports_gpu_direct: ClassVar[bool] = False  # payloads may stay on the GPU end to end
    cross_process: ClassVar[bool] = True  # sender and receiver may live in different processes
    cross_host: ClassVar[bool] = True  # ... and on different hosts
    # senders may dial the decode side through an HTTP CONNECT proxy (constructor argument ``proxy="host:port"``)
    dials_through_proxy: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where senders reach this manager; the decode side puts it in its leases."""

    @abc.abstractmethod
    def expect(self, lease: Lease, sink: Sink, *, on_done: Callable[[dict], None] | None = None) -> KVReceiver:
        """Decode side: register a receiver for ``lease`` (call before handing out the lease).

        ``on_done(meta)`` runs on the transport thread right after SUCCESS. Raises ``ValueError`` when a live
        transfer already has this request id.
        """

    @abc.abstractmethod
    def sender(self, lease: Lease, *, codec: Codec | None = None) -> KVSender:
        """Prefill side: start the transfer described by a lease issued by a manager of the same transport.

        ``codec``: encodes this transfer's layers instead of the manager's default codec (e.g. a
        :class:`~kv_transfer.compression.ModalCodec` for the request's policy); the receiving process must have a
        codec of the same ``name`` registered.

        An unreachable peer does not raise here: the sender ends FAILED with :class:`PeerUnavailable`. Raises
        ``ValueError`` for a lease of another transport and :class:`PeerUnavailable` when this manager is closed.
        """

    @abc.abstractmethod
    def refused(self) -> dict[str, int]:
        """Frames and peers this manager refused (:class:`Unauthenticated` and subclasses), by class name."""

    @abc.abstractmethod
    def num_active(self) -> int:
        """Senders and receivers of this manager not yet terminal (0 after every finished scenario)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort live transfers (the peers see TransferAborted), release connections and threads. Idempotent."""

    def lease(self, request_id: str, *, num_blocks: int, layout: KVLayout, deadline_s: float | None = None,
              state: StateLayout | None = None) -> Lease:
        """A lease pointing at this manager; the deadline defaults to :func:`transfer_deadline` of the bytes (KV and
        state)."""
        if deadline_s is None:
            deadline_s = transfer_deadline(layout.transfer_nbytes(num_blocks) + (state.transfer_nbytes if state else 0))
        return Lease(request_id, num_blocks, layout, self.name, self.endpoint, deadline_s, state=state)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
