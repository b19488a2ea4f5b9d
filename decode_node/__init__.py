"""Decode worker (Ray actor): block pre-allocation and leases, KV receive, continuous-batching decode, MoE shard.

Built on :mod:`engine`; the disaggregated serving issue fills this package in.
"""
