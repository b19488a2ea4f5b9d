"""The control plane proper: :mod:`~cluster.control.spec` (the validated cluster config),
:mod:`~cluster.control.disagg` (moves each request through a (prefill, decode) pair, retries once on another),
:mod:`~cluster.control.worker_pool` (starts the actors, resizes, drains and heals the pools),
:mod:`~cluster.control.worker` (one worker as the front-end sees it, the one owner of its load, and an attempt's
hold on its pair), :mod:`~cluster.control.streams` (decode pollers and per-request inboxes),
:mod:`~cluster.control.delta` (what a request's stream yields), :mod:`~cluster.control.admission` (prefill admission,
decode placement), :mod:`~cluster.control.completion` (the batch API's result), :mod:`~cluster.control.errors` (the
control plane's typed errors), :mod:`~cluster.control.cluster_ops` (status rows and summaries),
:mod:`~cluster.control.router` (pure request placement), :mod:`~cluster.control.pool_healer` (replaces dead
workers), :mod:`~cluster.control.autoscale` (pure autoscaling decisions), :mod:`~cluster.control.timeline`
(per-request stage clock), :mod:`~cluster.control.expert_groups` (expert-parallel decode groups), and
:mod:`~cluster.control.local_pair` (the whole disaggregated data path in one process, no Ray: read it first).
"""
