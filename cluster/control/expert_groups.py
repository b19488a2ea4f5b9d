"""Wiring expert-parallel decode groups from a :class:`~cluster.control.spec.ClusterSpec`: the static placement a
group starts from, each decode worker's ``expert_parallel`` actor argument, and forming a group (rank 0 hosts the
rendezvous, every rank joins at once) that returns its :class:`~cluster.experts.expert_router.ExpertRouter`."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from typing import Any

from cluster.control.ray_epoch import EPOCH
from cluster.control.reattach import GroupState
from cluster.control.spec import ClusterSpec
from cluster.experts.expert_router import ExpertRouter, RebalancePolicy, from_slot_table, to_slot_table
from cluster.experts.placement import Placement, static_placement
from decode_node.expert_parallel import ExpertParallelConfig
from decode_node.expert_slots import SlotTable
from engine.config import TextConfig
from node_common import messages


def initial_placement(spec: ClusterSpec, text: TextConfig) -> Placement:
    """The static round-robin placement every group starts from."""
    moe_layers = sum(text.moe_layers)
    return static_placement(text.num_experts, spec.expert_parallel, spec.slots_per_worker(text.num_experts),
                            moe_layers)


def worker_configs(spec: ClusterSpec, text: TextConfig) -> list[dict | None]:
    """Per decode worker, its ``expert_parallel`` actor argument (None without expert parallelism)."""
    if spec.expert_parallel == 1:
        return [None] * spec.num_decode
    table = to_slot_table(initial_placement(spec, text), 0).to_wire()
    return [ExpertParallelConfig(rank=i % spec.expert_parallel, world=spec.expert_parallel,
                                 slots_per_worker=spec.slots_per_worker(text.num_experts), placement=table,
                                 timeout_s=spec.expert_group_timeout_s).to_dict() for i in range(spec.num_decode)]


def form_groups(spec: ClusterSpec, text: TextConfig, actors: list[Any], dtype_bytes: int,
                attached: Sequence[GroupState] = ()) -> list[ExpertRouter]:
    """Join consecutive runs of ``spec.expert_parallel`` decode actors into groups (rank 0 hosts the rendezvous;
    all ranks join at once, bounded by the group timeout) and return one router per group, not yet started. The
    first ``len(attached)`` runs are groups a restarted front-end reattached (:func:`cluster.control.reattach.
    place_groups`): still joined, they get a router that goes on from the placement they run."""
    if spec.expert_parallel == 1:
        return []
    world = spec.expert_parallel
    return [attach_group(spec, text, actors[g * world:(g + 1) * world], g, dtype_bytes, attached[g])
            if g < len(attached) else form_group(spec, text, actors[g * world:(g + 1) * world], g, dtype_bytes)
            for g in range(spec.num_decode // world)]


def attach_group(spec: ClusterSpec, text: TextConfig, members: list[Any], g: int, dtype_bytes: int,
                 state: GroupState) -> ExpertRouter:
    """The router of a live group (``members`` in rank order) that another front-end formed: its placement is the
    one the ranks run, and its next placement version follows the newest any rank has seen."""
    router = _router(spec, text, members, g, dtype_bytes, from_slot_table(SlotTable.from_wire(state.placement)))
    router.version = state.version
    return router


def form_group(spec: ClusterSpec, text: TextConfig, members: list[Any], g: int, dtype_bytes: int) -> ExpertRouter:
    """Join ``members`` (fresh decode actors of ranks 0..world-1, started with :func:`worker_configs`'s configs
    for group ``g``) into group ``g`` and return its router, not yet started. Also re-forms a group that lost a
    member (:mod:`cluster.control.pool_healer`): the group starts again from the static placement under a new key."""
    import ray

    timeout = spec.expert_group_timeout_s + 30
    where = messages.unpack(ray.get(members[0].ep_host.remote(spec.expert_group_host), timeout=timeout))
    key = f"g{g}-{uuid.uuid4().hex[:8]}"
    for reply in ray.get([a.ep_join.remote(where["host"], where["port"], key) for a in members], timeout=timeout):
        messages.unpack(reply)  # raises GroupUnavailable of a rank that could not join
    return _router(spec, text, members, g, dtype_bytes, initial_placement(spec, text))


def _router(spec: ClusterSpec, text: TextConfig, members: list[Any], g: int, dtype_bytes: int,
            placement: Placement) -> ExpertRouter:
    policy = RebalancePolicy(interval_s=spec.expert_rebalance_s, max_moves=spec.expert_max_moves)
    per_expert = 3 * text.hidden_size * text.moe_intermediate_size * dtype_bytes
    return ExpertRouter(members, placement, bytes_per_expert=per_expert, policy=policy, name=f"ep-{g}",
                        guard=functools.partial(EPOCH.use, EPOCH.current))
