"""Qwen3-VL(-MoE): M-RoPE text model, native-resolution vision tower with DeepStack. See
:mod:`engine.models.qwen3_vl.family`."""
