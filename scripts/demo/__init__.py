"""Training the shipped demo model (``python -m scripts.demo.train OUT_DIR``), not part of the installed runtime:
:mod:`scripts.demo.train` (the Qwen3-VL-MoE demo) and its tokenizer trainer :mod:`scripts.demo.tokenizer`;
:mod:`scripts.demo.train_llava` reproduces the LLaVA test fixture (``tests/fixtures/llava_demo``); the tasks they train
on are :mod:`duet_testing.demo_tasks` (the benchmarks use them too)."""
