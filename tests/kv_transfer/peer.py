"""Entry points of spawned peer processes (prefill side) for the two-process tests.

The KV data is never shipped to the parent: both sides regenerate it from (seed, layer) with ``kvutil.make_kv``.
Results go back on a multiprocessing queue as plain tuples (test control plane only).
"""

from __future__ import annotations

import random
import time

import torch

from kv_transfer import Lease
from tests.kv_transfer.kvutil import make_kv, make_manager


def prefill_main(transport: str, leases: list[dict], seeds: list[int], mode: str, results,
                 device: str = "cpu") -> None:
    """``mode="all"``: send every layer of every lease (shuffled, interleaved) and finish; report sender states.
    ``mode="hang"``: send layers 0 and 1 of the first lease, report ``"sent"``, then sleep until killed.
    ``device``: where the layers are before ``send_layer`` (``"cuda:1"`` for the NCCL test)."""
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    manager = make_manager(transport)
    try:
        senders = [manager.sender(Lease.from_dict(d)) for d in leases]
        if mode == "hang":
            lease = senders[0].lease
            for layer in (0, 1):
                senders[0].send_layer(layer, *make_kv(lease.layout, lease.num_blocks, seed=seeds[0], layer=layer))
            results.put(("sent",))
            time.sleep(120)
            return
        jobs = [(i, layer) for i, s in enumerate(senders) for layer in range(s.lease.layout.num_layers)]
        random.Random(0).shuffle(jobs)
        for i, layer in jobs:
            lease = senders[i].lease
            k, v = make_kv(lease.layout, lease.num_blocks, seed=seeds[i], layer=layer)
            senders[i].send_layer(layer, k.to(device), v.to(device))
        for i, s in enumerate(senders):
            s.finish({"seed": seeds[i]})
        states = [s.wait(30).name for s in senders]
        results.put(("done", states, [repr(s.failure_exception()) for s in senders]))
    finally:
        if mode != "hang":
            manager.close()
