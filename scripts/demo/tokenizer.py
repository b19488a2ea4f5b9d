"""The demo models' tokenizer: byte-level BPE trained on the task's text, with chat special tokens and a template.

Two families: ``qwen3_vl_moe`` (the shipped demo: Qwen's chat and vision markers, ``<|im_start|>`` /
``<|im_end|>``, each image as ``<|vision_start|><|image_pad|><|vision_end|>``) and ``llava`` (the test fixture:
``<|user|>`` / ``<|end|>`` and one ``<image>`` per image). Saved as ``tokenizer.json`` + ``tokenizer_config.json``
(+ ``chat_template.jinja``) so both transformers and Duet load it. Deterministic: the training corpus is the task's
fixed string set.

Both templates write a user turn's images after its text, so the visual tokens are computed knowing the question:
finding "the triangle" among the shapes becomes a test each visual token makes of itself, not a lookup the answer has
to make across all of them (with the image first, colour / place answers stayed at chance between the shapes of a
scene while descriptions were 99% right). The price: an image's KV depends on the question asked about it, so two
questions about one image share no prefix-cache blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from duet_testing.demo_tasks import corpus

FAMILIES = ("qwen3_vl_moe", "llava")
IMAGE_TOKEN = "<image>"  # Duet's placeholder in prompt text (the llava family's image token too)

# llava family (the test fixture)
USER, ASSISTANT, END, PAD = "<|user|>", "<|assistant|>", "<|end|>", "<pad>"
SPECIAL_TOKENS = [PAD, END, USER, ASSISTANT, IMAGE_TOKEN]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "<|user|>{{ m['content'].replace('<image>', '') }}{{ '<image>' * m['content'].count('<image>') }}<|end|>"
    "{% else %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# qwen3_vl_moe family (the shipped demo)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
QWEN_SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]
QWEN_VISION = VISION_START + IMAGE_PAD + VISION_END
# content as a string (each <image> a picture) or as OpenAI / transformers parts ({"type": "text"} and image parts);
# either way the text first, then one vision block per image
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'].replace('<image>', '') }}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' * m['content'].count('<image>') }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% for p in m['content'] %}{% if p['type'] != 'text' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_prompt(question: str, family: str = "qwen3_vl_moe") -> str:
    """The template applied to one user turn, with the generation prompt (what the model sees): the question's
    text, then each image it carries (``<image>`` in the question)."""
    n = question.count(IMAGE_TOKEN)
    text = question.replace(IMAGE_TOKEN, "")
    if family == "llava":
        return f"{USER}{text}{IMAGE_TOKEN * n}{END}{ASSISTANT}"
    return f"{IM_START}user\n{text}{QWEN_VISION * n}{IM_END}\n{IM_START}assistant\n"


def end_token(family: str = "qwen3_vl_moe") -> str:
    """The token that ends an answer."""
    return END if family == "llava" else IM_END


def pad_token(family: str = "qwen3_vl_moe") -> str:
    return PAD if family == "llava" else ENDOFTEXT


def train_tokenizer(vocab_size: int = 384, family: str = "qwen3_vl_moe") -> Tokenizer:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS if family == "llava" else QWEN_SPECIAL_TOKENS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = corpus() if family == "llava" else [*corpus(), "user\n", "assistant\n"]
    tok.train_from_iterator(texts * 4, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path, family: str = "qwen3_vl_moe") -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if family == "llava":
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "pad_token": PAD,
               "eos_token": END, "image_token": IMAGE_TOKEN, "extra_special_tokens": {"image_token": IMAGE_TOKEN},
               "clean_up_tokenization_spaces": False}
    else:
        (path / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "pad_token": ENDOFTEXT,
               "eos_token": IM_END, "bos_token": None, "extra_special_tokens": QWEN_SPECIAL_TOKENS[1:],
               "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
