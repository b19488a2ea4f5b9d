"""gRPC streaming transport (one client-streaming Push call per request): ``Manager``, ``Sender``, ``Receiver``."""

from kv_transfer.grpc.client import Sender
from kv_transfer.grpc.manager import Manager
from kv_transfer.grpc.server import Receiver

__all__ = ["Manager", "Receiver", "Sender"]
