"""The demo model's tokenizer: byte-level BPE trained on the task's text, with chat special tokens and a template.

Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``) so both transformers and Duet load
it. Deterministic: the training corpus is the task's fixed string set.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from duet_testing.demo_tasks import corpus

IMAGE_TOKEN, USER, ASSISTANT, END, PAD = "<image>", "<|user|>", "<|assistant|>", "<|end|>", "<pad>"
SPECIAL_TOKENS = [PAD, END, USER, ASSISTANT, IMAGE_TOKEN]
# A user turn's images go after its text, so the visual tokens are computed knowing the question: finding "the
# triangle" among the shapes becomes a test each visual token makes of itself, not a lookup the answer has to make
# across all of them (with the image first, colour / place answers stayed at chance between the shapes of a scene
# while descriptions were 99% right). The price: an image's KV depends on the question asked about it, so two
# questions about one image share no prefix-cache blocks.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "<|user|>{{ m['content'].replace('<image>', '') }}{{ '<image>' * m['content'].count('<image>') }}<|end|>"
    "{% else %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_prompt(question: str) -> str:
    """The template applied to one user turn, with the generation prompt (what the model sees): the question's
    text, then one ``<image>`` per image it carries."""
    images = IMAGE_TOKEN * question.count(IMAGE_TOKEN)
    return f"{USER}{question.replace(IMAGE_TOKEN, '')}{images}{END}{ASSISTANT}"


def train_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = corpus()
    tok.train_from_iterator(texts * 4, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "pad_token": PAD, "eos_token": END,
        "image_token": IMAGE_TOKEN, "extra_special_tokens": {"image_token": IMAGE_TOKEN},
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
