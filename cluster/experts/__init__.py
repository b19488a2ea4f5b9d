"""Expert placement and caching for the decode pool: :mod:`~cluster.experts.placement` (pure placement algorithm,
kernels in :mod:`~cluster.experts.placement_pack`), :mod:`~cluster.experts.expert_router` (one router per
expert-parallel group: load, rebalance, group forming), :mod:`~cluster.experts.expert_cache` (the tiered expert-cache
simulation over routing traces; the policies themselves are :mod:`node_common.expert_policies`).
"""
