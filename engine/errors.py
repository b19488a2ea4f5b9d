"""Typed errors raised by the engine, and the registry that keeps every Duet error's type across processes.

Every error a user can cause (bad checkpoint, bad request) is a subclass of :class:`DuetError`, carries a one-line
message naming the problem, and leaves the engine unchanged: no request is half-admitted and no KV block is held.
The CLI prints ``str(err)`` and exits with code 2.

**Error codes.** A class that crosses a process boundary declares a stable ``code`` (a class attribute in its own
body); defining the class registers it (:data:`REGISTRY`), wherever it lives -- the engine, ``kv_transfer``, the
worker packages, the cluster -- since this module imports nothing of Duet. ``retryable`` says whether the same request
may succeed on another prefill/decode pair (a broken expert-parallel group, a failed transfer, a full pool). The wire
carries the code (``node_common.messages.error_reply``); :func:`error_for_code` turns it back into the class, or into the
nearest known one (plain :class:`DuetError`) when the receiver does not have it. Errors outside this tree (e.g.
``kv_transfer``'s, which may not import the engine) join with :func:`register`.
"""

from __future__ import annotations

from typing import ClassVar

REGISTRY: dict[str, type[BaseException]] = {}  # code -> class


def register(cls: type[BaseException], code: str, *, retryable: bool = False) -> type[BaseException]:
    """Register ``cls`` under ``code`` (and set both as its class attributes). Codes are unique: a second class
    under a taken code is a programming error (re-defining the same class, as a module reload does, is not)."""
    assert code and code.replace("_", "").replace(".", "").isalnum(), f"bad error code {code!r}"
    held = REGISTRY.get(code)
    if held is not None and held is not cls and held.__qualname__ != cls.__qualname__:
        raise TypeError(f"error code {code!r} is taken by {held.__module__}.{held.__qualname__}")
    cls.code, cls.retryable = code, retryable  # type: ignore[attr-defined]
    REGISTRY[code] = cls
    return cls


def error_for_code(code: str | None) -> type[BaseException]:
    """The class registered under ``code``, or :class:`DuetError` for an unknown or missing one."""
    return REGISTRY.get(code or "", DuetError)


def is_retryable(e: BaseException) -> bool:
    """Whether another prefill/decode pair may serve the request that failed with ``e`` (its class, or the
    registered base it inherits from, says ``retryable``)."""
    return getattr(type(e), "retryable", False) is True


class DuetError(Exception):
    """Base class of every error Duet raises on purpose. Subclasses that cross a process boundary set ``code``
    (and ``retryable`` when another worker pair may succeed) in their own body; that registers them."""

    code: ClassVar[str] = "duet"
    retryable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:  # a subclass without its own code travels as its nearest registered base
            register(cls, cls.__dict__["code"], retryable=cls.__dict__.get("retryable", False))


register(DuetError, "duet")


class CheckpointError(DuetError):
    """The checkpoint directory is missing, incomplete, or its tensors do not match its config."""
    code = "checkpoint"


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but its architecture (``model_type``, activation, ...) is not supported."""
    code = "unsupported_model"


class InvalidRequestError(DuetError, ValueError):
    """A request is malformed; nothing was admitted."""
    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus at least one generated token) does not fit the model's context or the KV pool."""
    code = "prompt_too_long"


class RequestTooLargeError(PromptTooLongError):
    """The request's KV (at the precision it would be stored at) exceeds everything this worker's memory budget can
    ever give it; the message names the bytes. Nothing was reserved."""
    code = "request_too_large"


class TokenOutOfVocabError(InvalidRequestError):
    """A token id is negative or not below the vocabulary size."""
    code = "token_out_of_vocab"


class ImageDecodeError(InvalidRequestError):
    """An image could not be opened or decoded."""
    code = "image_decode"


class ImageTokenMismatchError(InvalidRequestError):
    """The number of image placeholder tokens does not match the images given."""
    code = "image_token_mismatch"


class UnsupportedInputError(InvalidRequestError):
    """The request uses an input kind the model has but Duet does not serve yet (video)."""
    code = "unsupported_input"


class OutOfBlocksError(DuetError):
    """The KV pool cannot hold the request right now (retry later or on another worker); nothing was reserved."""
    code = "out_of_blocks"
    retryable = True


class RequestAbortedError(DuetError):
    """The request was aborted before it finished."""
    code = "request_aborted"
