"""The typed errors a KV transfer ends with (``failure_exception()``), and their names on the wire.

The bottom of ``kv_transfer``: it imports nothing of Duet, so the codecs, frames and the contract
(:mod:`kv_transfer.base`, which re-exports these) can all raise them. ``node_common.messages`` registers every class
here with the engine's error-code registry (``kv_transfer`` may not import the engine).
"""

from __future__ import annotations


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
