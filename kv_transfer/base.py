"""The KV-transfer contract: poll states and the sender / receiver / manager interfaces.

Who calls what:

* The DECODE side owns the lease. It allocates blocks for a request, builds a :class:`Lease` (``manager.lease(...)``),
  calls ``manager.expect(lease, sink)`` and only then hands ``lease.to_dict()`` to the prefill side (through Ray).
* The PREFILL side calls ``manager.sender(lease)`` once per request, ``send_layer`` once per layer as each layer's KV
  is ready (any order), then ``finish(meta)`` once. It learns the outcome by ``poll()`` / ``wait()``.
* Either side may ``abort(reason)`` at any time; the other side ends FAILED with :class:`TransferAborted` promptly.
* Every transfer ends FAILED with :class:`TransferTimeout` at the latest when its lease runs out (``lease.deadline_s``,
  or ``transfer_s`` after it started for a lease with ``start_by_s``: :mod:`kv_transfer.lease`).

The values the contract speaks of live below it, so that codecs and frames need not import the contract: the typed
error tree (:mod:`kv_transfer.errors`), the layouts (:mod:`kv_transfer.layout`) and the versioned lease with its
deadline policy (:mod:`kv_transfer.lease`). This module re-exports them: ``kv_transfer.base`` is the one name a
transport or a worker imports. It imports torch only for dtype names; it never imports the model.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kv_transfer.errors import (  # noqa: F401 - re-exported: part of the contract
    ERRORS,
    ChecksumMismatch,
    FrameReplayed,
    LeaseMismatch,
    MissingLayer,
    PeerUnavailable,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    Unauthenticated,
    error_from_name,
)
from kv_transfer.layout import DTYPES, KVLayout, StateLayout, TensorSpec  # noqa: F401 - re-exported
from kv_transfer.lease import (  # noqa: F401 - re-exported
    DEFAULT_LEASE,
    LEASE_VERSION,
    Lease,
    LeasePolicy,
    transfer_deadline,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from kv_transfer.codec import Codec, CodecContext


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


class KVSender(abc.ABC):
    """Prefill side of one request's transfer. Made by ``KVManager.sender(lease)``; used from one thread.

    * ``send_layer(layer, k, v, ctx=None)``: once per layer, any order. Non-blocking: copies ``k``/``v`` and the
      context's tensors (so the caller may reuse its buffers as soon as it returns) and enqueues; encoding,
      checksums and I/O run on a transport thread. ``ctx`` (:class:`~kv_transfer.codec.CodecContext`: valid
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

    What the decode side may set or read besides the methods (every receiver has these; the defaults below are what
    a receiver that does not override them means):

    * ``decode_device``: where received payloads are decoded (after their checksums), set by the decode side right
      after ``expect`` like ``state_sink`` -- the pool's device, so compressed layers are decoded where they land.
      None (the default): where the payload arrives.
    * ``wire_bytes``: payload bytes of the verified layers so far (what travelled, after compression), read once the
      receiver is terminal. None (the default): this receiver does not count them; the decode side then reports the
      decoded bytes.
    """

    lease: Lease
    state_sink: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    decode_device: torch.device | None = None
    wire_bytes: int | None = None

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
