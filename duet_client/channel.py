"""Channels, credentials, call metadata and the retry policy shared by :class:`Client` and :class:`AsyncClient`."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),  # retries are ours: only UNAVAILABLE, only before the first token
]


@dataclass(frozen=True)
class TLSConfig:
    """TLS for the channel. ``root_certificates``: the CA bundle (PEM bytes or a path; None = system roots);
    ``certificate_chain``/``private_key``: a client certificate for mutual TLS; ``server_name``: override the name
    checked against the server's certificate (e.g. when dialling an IP address)."""

    root_certificates: bytes | str | Path | None = None
    certificate_chain: bytes | str | Path | None = None
    private_key: bytes | str | Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_pem(self.root_certificates), _pem(self.private_key),
                                            _pem(self.certificate_chain))


def _pem(v: bytes | str | Path | None) -> bytes | None:
    return v if isinstance(v, bytes) or v is None else Path(v).read_bytes()


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a call that failed with UNAVAILABLE before any token arrived: up to ``max_attempts`` calls in all,
    sleeping ``initial_backoff_s * multiplier**n`` (capped, with +-20% jitter) between them, within the deadline."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.2
    multiplier: float = 2.0
    max_backoff_s: float = 3.0

    def backoff_s(self, retry: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** retry)
        return base * random.uniform(0.8, 1.2)


def tls_options(tls: bool | TLSConfig | None) -> tuple[grpc.ChannelCredentials | None, list]:
    """(credentials or None for plaintext, extra channel options) for ``tls``."""
    if not tls:
        return None, []
    cfg = tls if isinstance(tls, TLSConfig) else TLSConfig()
    extra = [("grpc.ssl_target_name_override", cfg.server_name)] if cfg.server_name else []
    return cfg.credentials(), extra


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
