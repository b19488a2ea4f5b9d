"""Prefill worker (Ray actor): admission queue, vision-encoder cache, chunked prefill, per-layer KV hand-off.

Built on :mod:`engine`; the disaggregated serving issue fills this package in.
"""
