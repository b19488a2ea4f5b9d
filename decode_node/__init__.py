"""Decode worker (Ray actor): block pre-allocation and leases, KV receive, continuous-batching decode, MoE experts.

* :mod:`decode_node.worker` -- :class:`~decode_node.worker.DecodeWorker`: reserves blocks and issues leases, commits
  verified transfers and their hand-offs, decodes in one continuous batch (its module docstring lists the queues a
  request moves through); one :class:`~decode_node.request_state.DecodeRequest` per request
  (:mod:`decode_node.request_state`, which also turns each step into typed events).
* :mod:`decode_node.actor` -- :class:`~decode_node.actor.DecodeActor`: the Ray actor and its loop thread; the front-end
  long-polls it for :mod:`node_common.events`.
* expert parallelism across a decode group: :mod:`~decode_node.expert_parallel` (the rank), ``expert_group`` (the
  group's lockstep ticks), ``expert_dispatch`` (token dispatch / combine), ``expert_shard`` and ``expert_slots``
  (which experts a rank holds), ``expert_weights``;
* tiered expert memory on one worker (resident / host, with pre-warm): :mod:`~decode_node.expert_tiers` over
  ``expert_residency``.

Built on :mod:`engine`, :mod:`kv_transfer` and :mod:`node_common`.
"""
