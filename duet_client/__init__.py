"""Duet's gRPC client SDK (depends on grpcio and protobuf only).

    from duet_client import Client
    client = Client("127.0.0.1:50051", token=None)
    print(client.generate_text("<image>Describe the image.", images=["examples/shapes.png"]).text)

:class:`Client` (sync) and :class:`AsyncClient` (asyncio) stream :class:`Delta` objects from ``generate`` and return
a :class:`Completion` from ``generate_text``; errors are the typed exceptions of :mod:`duet_client.errors`. The
generated ``duet.v1`` stubs are in :mod:`duet_client._proto` (the server imports them from here too).
"""

from duet_client.aio import AsyncClient, AsyncTokenStream
from duet_client.channel import RetryPolicy, TLSConfig
from duet_client.client import Client, TokenStream
from duet_client.errors import (
    Cancelled,
    DeadlineExceeded,
    DuetClientError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from duet_client.types import Choice, Completion, Delta, TokenLogprob, ToolCall, Usage

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncTokenStream", "Cancelled", "Choice", "Client", "Completion", "DeadlineExceeded", "Delta",
    "DuetClientError", "Internal", "InvalidArgument", "NotFound", "ResourceExhausted", "RetryPolicy", "TLSConfig",
    "TokenLogprob", "TokenStream", "ToolCall", "Unauthenticated", "Unavailable", "Usage",
]
