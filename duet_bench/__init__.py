"""Benchmarks (``duet bench ...``): a package of their own, apart from the runtime, which never imports it (only
``duet bench``'s subcommand module, :mod:`cluster.cli.bench_cmd`, loads one, lazily). Its dependencies come with the
``bench`` extra: ``pip install 'duet-serve[bench]'`` (transformers, the reference every bench reports a ratio against,
and matplotlib for ``duet bench serve``'s plots). Tiny checkpoints come from :mod:`duet_testing`.
"""
