"""Qwen3.5(-MoE): a hybrid Gated DeltaNet / gated-attention decoder under Qwen3-VL's tower. See
:mod:`engine.models.qwen3_5.family`."""
