"""The control plane proper: :mod:`~cluster.control.spec` (the validated cluster config),
:mod:`~cluster.control.disagg` (builds the prefill and decode actors and moves each request through them),
:mod:`~cluster.control.admission` (per-worker state, prefill admission, decode placement),
:mod:`~cluster.control.completion` (the batch API's result), :mod:`~cluster.control.errors` (the control plane's typed
errors), :mod:`~cluster.control.cluster_ops` (status, pool resizing, draining), :mod:`~cluster.control.router` (pure
request placement), :mod:`~cluster.control.pool_healer` (replaces dead workers), :mod:`~cluster.control.autoscale` (pure
autoscaling decisions), :mod:`~cluster.control.timeline` (per-request stage clock), and
:mod:`~cluster.control.local_pair` (the whole disaggregated data path in one process, no Ray: read it first).
"""
