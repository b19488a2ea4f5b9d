"""Test and benchmark helpers, never imported by the runtime: tiny random-weight checkpoints in the layouts
transformers 5 saves and the released checkpoints use (:mod:`duet_testing.checkpoints` for LLaVA,
:mod:`duet_testing.qwen_checkpoints` for Qwen3-VL(-MoE), :mod:`duet_testing.qwen35_checkpoints` for Qwen3.5(-MoE)),
their tokenizer (:mod:`duet_testing.tiny_tokenizer`), the demo model's task generator
(:mod:`duet_testing.demo_tasks`, shared with the demo's training script and the quality bench) and a second,
independent drawing of the same task (:mod:`duet_testing.outside_shapes`, images the generator never makes).

Installed with the ``bench`` extra's dependencies (``transformers`` builds and checks the checkpoints).
"""
