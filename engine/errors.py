"""Typed errors raised by the engine.

Every error a user can cause (bad checkpoint, bad request) is a subclass of :class:`DuetError`, carries a one-line
message naming the problem, and leaves the engine unchanged: no request is half-admitted and no KV block is held.
The CLI prints ``str(err)`` and exits with code 2.
"""

from __future__ import annotations


class DuetError(Exception):
    """Base class of every error Duet raises on purpose."""


class CheckpointError(DuetError):
    """The checkpoint directory is missing, incomplete, or its tensors do not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but its architecture (``model_type``, activation, ...) is not supported."""


class InvalidRequestError(DuetError, ValueError):
    """A request is malformed; nothing was admitted."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus at least one generated token) does not fit the model's context or the KV pool."""


class TokenOutOfVocabError(InvalidRequestError):
    """A token id is negative or not below the vocabulary size."""


class ImageDecodeError(InvalidRequestError):
    """An image could not be opened or decoded."""


class ImageTokenMismatchError(InvalidRequestError):
    """The number of image placeholder tokens does not match the images given."""


class UnsupportedInputError(InvalidRequestError):
    """The request uses an input kind the model has but Duet does not serve yet (video)."""


class OutOfBlocksError(DuetError):
    """The KV pool cannot hold the request right now (retry later or on another worker); nothing was reserved."""


class RequestAbortedError(DuetError):
    """The request was aborted before it finished."""
