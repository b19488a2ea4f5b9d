"""LLaVA: a decoder (Qwen3-MoE, Mixtral, Qwen3, Llama, Mistral) with an optional SigLIP / CLIP tower and projector;
also the bare decoders. See :mod:`engine.models.llava.family`."""
