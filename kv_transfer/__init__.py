"""The KV wire between a prefill worker and a decode worker: block codec, transports, transfer state machine.

Must not import the model (``engine``).

A transfer is one request's KV, all layers, plus a final metadata frame. Contract: :mod:`kv_transfer.base` (over
the error tree :mod:`kv_transfer.errors`, the layouts :mod:`kv_transfer.layout` and the lease and its deadline policy
:mod:`kv_transfer.lease`: :class:`LeasePolicy`, :data:`DEFAULT_LEASE`).
Compression on the wire: :mod:`kv_transfer.compression` (per-modality policies, codec ``"modal"``).
Transports (same class names ``Manager`` / ``Sender`` / ``Receiver`` in each sub-package; pick one with
:func:`get_manager_class`): ``inproc`` (queues, one process), ``gloo`` / ``nccl`` (torch.distributed pair groups),
``grpc`` (client-streaming calls).

Queues and states, decode side::

    expect(lease, sink)                      WAITING        registered in its manager, blocks reserved
      -> frames arrive on a transport thread TRANSFERRING   each layer verified (crc32), decoded, then sink()
      -> finish frame, every layer present   SUCCESS        meta available; the sender is told ("done")
      (checksum / missing layer / abort / deadline / peer gone -> FAILED, the sender is told when it can be)

Prefill side::

    sender(lease)                            BOOTSTRAPPING  connection to the decode manager being set up
      -> connected, open frame queued        WAITING
      -> send_layer(): copy, queue; a transport thread encodes and sends       TRANSFERRING
      -> finish(meta) sent and the receiver reported success                   SUCCESS

States only move forward (:class:`KVPoll` is ordered); FAILED carries a typed :class:`TransferError`
(``failure_exception()``). Every wait is bounded and every transfer ends by its lease deadline at the latest.
"""

from kv_transfer.auth import ClusterSecret, MissingSecret
from kv_transfer.base import (
                              DEFAULT_LEASE,
                              ChecksumMismatch,
                              FrameReplayed,
                              KVLayout,
                              KVManager,
                              KVPoll,
                              KVReceiver,
                              KVSender,
                              Lease,
                              LeaseMismatch,
                              LeasePolicy,
                              MissingLayer,
                              PeerUnavailable,
                              ProtocolError,
                              Sink,
                              StateLayout,
                              TensorSpec,
                              TransferAborted,
                              TransferError,
                              TransferTimeout,
                              Unauthenticated,
                              transfer_deadline,
)
from kv_transfer.codec import Codec, CodecContext, IdentityCodec, get_codec, register_codec
from kv_transfer.compression import (
                              CompressionPolicy,
                              InvalidPolicy,
                              Method,
                              ModalCodec,
                              codec_for,
                              needs_scores,
                              resolve_policy,
)
from kv_transfer.registry import TRANSPORTS, get_manager_class

__all__ = [
                              "DEFAULT_LEASE",
                              "TRANSPORTS",
                              "ChecksumMismatch",
                              "ClusterSecret",
                              "Codec",
                              "CodecContext",
                              "CompressionPolicy",
                              "FrameReplayed",
                              "IdentityCodec",
                              "InvalidPolicy",
                              "KVLayout",
                              "KVManager",
                              "KVPoll",
                              "KVReceiver",
                              "KVSender",
                              "Lease",
                              "LeaseMismatch",
                              "LeasePolicy",
                              "Method",
                              "MissingLayer",
                              "MissingSecret",
                              "ModalCodec",
                              "PeerUnavailable",
                              "ProtocolError",
                              "Sink",
                              "StateLayout",
                              "TensorSpec",
                              "TransferAborted",
                              "TransferError",
                              "TransferTimeout",
                              "Unauthenticated",
                              "codec_for",
                              "get_codec",
                              "get_manager_class",
                              "needs_scores",
                              "register_codec",
                              "resolve_policy",
                              "transfer_deadline",
]
