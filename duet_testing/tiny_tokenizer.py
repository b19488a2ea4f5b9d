"""The tokenizer of tiny test checkpoints: byte-level BPE sized exactly to a :class:`~duet_testing.checkpoints.TinySpec`'s
vocabulary, special tokens at the spec's ids, BOS added by the post-processor; loads in transformers too."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Protocol


class TokenizerSpec(Protocol):
    """What the tokenizer needs of a checkpoint spec (:class:`duet_testing.checkpoints.TinySpec` has it)."""

    vocab_size: int
    seed: int

    @property
    def special_token_ids(self) -> dict[str, int]: ...


def _byte_alphabet() -> list[str]:
    """GPT-2 byte-to-unicode symbols, most useful bytes first (printable ASCII, whitespace, high bytes, controls)."""
    from tokenizers import pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # the pre-tokenizer's own mapping (bytes_to_unicode)
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    order = [*range(32, 127), 10, 9, 13, *range(128, 256), *range(0, 9), 11, 12, *range(14, 32), 127]
    return [table[b] for b in order]


def _train_merges(n_tokens: int, seed: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE with ``n_tokens`` entries (fewer if the corpus runs out), trained on seeded pseudo-words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    words = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(100))
             for _ in range(min(4000, n_tokens // 4 + 1))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=n_tokens, initial_alphabet=_byte_alphabet(), show_progress=False)
    tok.train_from_iterator(words, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].__getitem__)
    return vocab, [tuple(m) for m in model["merges"]]


def write_tokenizer(path: Path, spec: TokenizerSpec) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE, specials at ``spec.special_token_ids``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = spec.special_token_ids
    n_regular = spec.vocab_size - len(specials)
    if n_regular <= 256:  # no room for merges: the most useful bytes only; other bytes are dropped
        tokens, merges = _byte_alphabet()[:n_regular], []
    else:
        tokens, merges = _train_merges(n_regular, spec.seed)
        tokens += [f"<unused{i}>" for i in range(n_regular - len(tokens))]  # corpus ran out of merges
    regular_ids = [i for i in range(spec.vocab_size) if i not in specials.values()]
    vocab = {**dict(zip(tokens, regular_ids)), **specials}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens if t.startswith("<unused")])
    bos = ("<s>", specials["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos])
    assert tok.get_vocab_size(with_added_tokens=True) == spec.vocab_size
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    ).save_pretrained(path)
