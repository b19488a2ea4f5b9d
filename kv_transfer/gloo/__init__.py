"""torch.distributed point-to-point transport (gloo on CPU; ``NcclManager`` for CUDA payloads over NCCL):
``Manager``, ``Sender``, ``Receiver``."""

from kv_transfer.gloo.manager import Manager, NcclManager, Receiver, Sender

__all__ = ["Manager", "NcclManager", "Receiver", "Sender"]
