"""Chat messages -> prompt text through the checkpoint's chat template, for ``duet serve`` and ``duet generate``.

Messages arrive as ``{"role", "content": str}`` with Duet's ``<image>`` placeholder marking each image's place
(OpenAI ``image_url`` parts become ``<image>`` in :mod:`cluster.serve.openai_requests`). A LLaVA checkpoint's
template gets the strings as they are (the engine expands ``<image>``). A Qwen3-VL checkpoint's template gets OpenAI /
transformers-style content parts instead (``{"type": "image"}`` and ``{"type": "text", "text"}``), as transformers'
``apply_chat_template`` does for a message with an image, so the rendered text (``<|vision_start|><|image_pad|>
<|vision_end|>`` per image, plus whatever the template adds around images) and hence the token ids are the same; a
template that does not render image parts (no ``<|image_pad|>`` per image in its output) gets the strings, and the
engine rewrites each ``<image>`` to the same markers.
"""

from __future__ import annotations

from typing import Any

from cluster.serve.tool_calls import parser_for, plain_tool_messages
from engine.config import ModelConfig
from engine.inputs import IMAGE_TOKEN, QWEN_IMAGE_PAD
from engine.tokenizer import Tokenizer


def content_parts(text: str) -> list[dict[str, Any]]:
    """``"<image>What is it?"`` -> ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]`` (empty text
    pieces dropped)."""
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(IMAGE_TOKEN)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def render_chat(tokenizer: Tokenizer, cfg: ModelConfig, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> str | None:
    """The conversation rendered with the checkpoint's template (with the assistant's generation prompt); ``None``
    when the checkpoint has no template. Raises :class:`~engine.errors.InvalidRequestError` when it fails.

    ``tools`` (OpenAI function tools) and the messages' ``tool_calls`` / ``tool`` role reach a template that renders
    them (it names ``tools``); for one that does not, :func:`~cluster.serve.tool_calls.plain_tool_messages` writes
    them into the messages in the model family's own tool-call syntax (its parser's)."""
    if tokenizer.chat_template is not None and "tools" not in tokenizer.chat_template:
        messages = plain_tool_messages(messages, tools, parser_for(cfg.text.model_type))
        tools = None
    if cfg.is_qwen_vl:
        # the pads the output must hold: one per <image>, plus any the text already writes in the checkpoint's markers
        num_pads = sum(m["content"].count(IMAGE_TOKEN) + m["content"].count(QWEN_IMAGE_PAD) for m in messages)
        parted = [{**m, "content": content_parts(m["content"])} if IMAGE_TOKEN in m["content"] else m
                  for m in messages]
        text = tokenizer.apply_chat_template(parted, tools=tools)
        if text is None or text.count(QWEN_IMAGE_PAD) == num_pads:
            return text
    return tokenizer.apply_chat_template(messages, tools=tools)
