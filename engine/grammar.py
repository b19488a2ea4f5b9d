"""Structured outputs: a request's grammar (:class:`~engine.grammar_spec.StructuredOutputsParams`) compiled by
llguidance and applied as a token mask in the sampler, through the engine's logits-processor hook.

Why llguidance (measured on this project's byte-level BPE tokenizers, CPU, one thread, against xgrammar 0.2.9 and
outlines-core 0.2.14; README "Structured outputs" has the figures): it builds its token trie straight from the
``tokenizers`` JSON the engine already loads (no transformers object, no vocabulary re-encoding), compiles a JSON
schema in about a millisecond (outlines-core builds a whole DFA index per schema; xgrammar precompiles per
grammar), computes each mask lazily in tens of microseconds, and ships as one Rust wheel without a GPU toolchain.

Contract with the engine (:class:`~engine.sampler.BatchedLogitsProcessor`): :meth:`GrammarProcessor.apply_batch`
fills one ``[rows, ceil(V / 32)]`` int32 bitmask for every grammar-constrained row of a step (whatever grammar each
row has) and applies it in one masked fill; :meth:`GrammarProcessor.accept` advances the row's matcher with every
appended token, including the first token a prefill worker sampled under the same mask (so a decode worker's
matcher, built from the request's grammar, is in the prefill side's state before its first step).

Termination: once the grammar is complete the mask allows EOS (and, when nothing can follow, only EOS), so a
constrained output ends with EOS, or at ``max_tokens`` (``finish_reason == "length"``: the only way a constrained
output can be incomplete). The mask wins over ``min_tokens``: a row whose every allowed token was suppressed gets
the grammar's tokens back.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.grammar_spec import StructuredOutputsParams
from engine.isolation import RequestFailedError
from engine.sampler import BatchedLogitsProcessor

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

class GrammarError(InvalidRequestError):
    """A structured-outputs spec that does not compile (bad JSON Schema, regex or grammar)."""

    code = "grammar"


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a runtime dependency; kept lazy so the engine imports without it
        raise GrammarError("structured outputs need the llguidance package (pip install llguidance)") from None
    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: :func:`validate` or a matcher does that)."""
    m = _llguidance().LLMatcher
    opts = {"whitespace_flexible": spec.whitespace_flexible}
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        try:
            return m.grammar_from_json_schema(schema, defaults=opts)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"response schema does not compile: {e}") from None
    if spec.regex is not None:
        return m.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return m.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    assert spec.grammar is not None
    return m.grammar_from_lark(spec.grammar)


def validate(spec: StructuredOutputsParams) -> None:
    """Raise :class:`GrammarError` unless ``spec`` compiles (no tokenizer needed: a front-end checks with it)."""
    err = _llguidance().LLMatcher.validate_grammar(grammar_text(spec))
    if err:
        raise GrammarError(f"structured outputs do not compile: {err.splitlines()[0][:500]}")


class GrammarFactory:
    """The engine's ``logits_processor_factory``: one :class:`GrammarProcessor` per sequence whose params carry
    ``structured_outputs`` (None for the others). Its tokenizer index is built on first use (a few hundred ms for
    a 150k vocabulary) and shared by every matcher.

    ``vocab_size`` is the logits' width (the model's, which may pad the tokenizer's); ``eos_token_ids`` the tokens
    that end an output."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _index(self):
        with self._lock:
            if self._lltok is None:
                if self._tokenizer is None or not self.eos_token_ids:
                    raise GrammarError("structured outputs need the checkpoint's tokenizer and an EOS token")
                n_vocab = max(self.vocab_size, self._tokenizer.vocab_size)
                self._lltok = _llguidance().LLTokenizer(self._tokenizer.backend_json(), n_vocab=n_vocab,
                                                        eos_token=self.eos_token_ids)
            return self._lltok

    def __call__(self, params: SamplingParams) -> GrammarProcessor | None:
        spec = params.structured_outputs
        if spec is None:
            return None
        matcher = _llguidance().LLMatcher(self._index(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured outputs do not compile: {matcher.get_error().splitlines()[0][:500]}")
        return GrammarProcessor(matcher, self.eos_token_ids, self._lltok.vocab_size)


class GrammarViolationError(RequestFailedError):
    """A token the request's grammar refuses was appended (only a defect lets one past the mask). The request ends
    with ``finish_reason "error"``, not with output that breaks its constraint presented as a natural stop."""

    code = "grammar_violation"


class GrammarProcessor(BatchedLogitsProcessor):
    """One sequence's grammar matcher (see the module docstring for the call contract)."""

    def __init__(self, matcher, eos_token_ids: list[int], n_vocab: int) -> None:
        self.matcher = matcher
        self._eos = eos_token_ids
        self.words = -(-n_vocab // 32)  # int32 words of this matcher's bitmask row
        self.rejected = 0  # tokens the matcher refused (0 unless something appended a token the mask forbade)

    def apply(self, logits: torch.Tensor) -> None:
        self.apply_batch(logits.unsqueeze(0), [0], [self])

    @classmethod
    def apply_batch(cls, logits: torch.Tensor, rows: list[int], procs: list[GrammarProcessor]) -> None:
        """In place on ``logits [S, V]``: row ``rows[i]`` keeps only what ``procs[i]``'s grammar allows next."""
        v = logits.shape[-1]
        mask = torch.zeros((len(procs), max(p.words for p in procs)), dtype=torch.int32)
        for i, p in enumerate(procs):
            p.fill(mask, i)
        # bit k of word w is token 32 w + k: the little-endian bytes of the words, unpacked least significant first
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, :v]).to(torch.bool)
        if allowed.shape[1] < v:  # logits wider than the tokenizer: padded rows are never text
            allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
        allowed = allowed.to(logits.device)
        whole = len(rows) == logits.shape[0]  # every row constrained: edit in place, no gather
        sub = logits if whole else logits[rows]
        sub.masked_fill_(~allowed, float("-inf"))
        dead = torch.isneginf(sub).all(dim=-1)  # min_tokens suppressed all the grammar allows: the grammar wins
        if bool(dead.any()):
            sub[dead] = torch.where(allowed[dead], 0.0, float("-inf"))
        if not whole:
            logits[rows] = sub

    def fill(self, mask: torch.Tensor, i: int) -> None:
        """Row ``i`` of ``mask`` (contiguous int32): the tokens allowed next (only EOS after an error)."""
        row = mask[i]
        if self.matcher.is_error():
            row.zero_()
            for t in self._eos:
                row[t // 32] |= _bit(t % 32)
            return
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)

    def accept(self, token_id: int) -> None:
        if self.matcher.is_stopped() and token_id in self._eos:
            return  # the EOS that ends a complete output: nothing left to match
        if not self.matcher.consume_token(token_id):
            self.rejected += 1
            why = next(iter((self.matcher.get_error() or "").splitlines()), "")[:300]
            logger.error("grammar rejected token %d: %s", token_id, why)
            raise GrammarViolationError(f"token {token_id} breaks the request's structured-output constraint ({why})")


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word (bit 31 as the negative int32 it is)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
