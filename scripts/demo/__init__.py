"""Training the shipped demo model (``python -m scripts.demo.train OUT_DIR``), not part of the installed runtime:
:mod:`scripts.demo.train` and its tokenizer trainer :mod:`scripts.demo.tokenizer`; the tasks it trains on are
:mod:`duet_testing.demo_tasks` (the benchmarks use them too)."""
