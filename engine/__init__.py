"""Duet's single-process model runtime: LLaVA-architecture multimodal (MoE) models over a paged KV cache."""

from engine.config import EngineConfig, ModelConfig
from engine.errors import (CheckpointError, DuetError, ImageDecodeError, ImageTokenMismatchError, InvalidRequestError,
                           PromptTooLongError, RequestTooLargeError, TokenOutOfVocabError, UnsupportedModelError)
from engine.hooks import EngineHooks
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineHooks", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "ModelConfig",
    "DuetError", "CheckpointError", "UnsupportedModelError", "InvalidRequestError", "PromptTooLongError",
    "TokenOutOfVocabError", "ImageDecodeError", "ImageTokenMismatchError", "RequestTooLargeError",
]
