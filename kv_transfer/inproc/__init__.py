"""In-process transport (queues between managers of one process): ``Manager``, ``Sender``, ``Receiver``."""

from kv_transfer.inproc.manager import Manager, Receiver, Sender

__all__ = ["Manager", "Receiver", "Sender"]
