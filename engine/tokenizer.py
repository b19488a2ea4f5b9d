"""Tokenizer and streaming detokenizer over the ``tokenizers`` library.

:class:`Tokenizer` reads a Hugging Face checkpoint's ``tokenizer.json`` and its side files and produces the same
ids as transformers' ``AutoTokenizer`` on those files: the special tokens named in ``tokenizer_config.json`` (or the
legacy ``special_tokens_map.json``) are added to the backend as transformers does, and truncation/padding saved in
``tokenizer.json`` are switched off (transformers' default call does not truncate or pad).
:class:`IncrementalDetokenizer` turns a growing list of generated ids into text deltas for streaming.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from engine.errors import CheckpointError, InvalidRequestError, TokenOutOfVocabError

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its special tokens, EOS ids and chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any], generation_config: dict[str, Any],
                 chat_template: str | None = None):
        """Wrap ``backend`` (already carrying the checkpoint's added tokens) with the parsed side files.

        ``config`` is ``tokenizer_config.json`` merged with ``special_tokens_map.json``; ``generation_config`` is
        ``generation_config.json`` (either may be empty).
        """
        self._backend = backend
        self._special = _special_token_strings(config)
        self._added = {token.content for token in backend.get_added_tokens_decoder().values()}
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces")) and not isinstance(
            backend.model, tokenizers.models.BPE)  # transformers ignores the clean-up for BPE
        self._prefix_ids, self._suffix_ids = _special_affixes(backend, self._added)
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        bos, eos = self._special.get("bos_token"), generation_config.get("eos_token_id")
        self.bos_token_id: int | None = self.token_to_id(bos) if bos else generation_config.get("bos_token_id")
        if eos is None and self._special.get("eos_token"):
            eos = self.token_to_id(self._special["eos_token"])
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) for i in eos):
            raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        self.eos_token_ids: list[int] = eos

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Load ``tokenizer.json`` plus, when present, ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``generation_config.json`` and ``chat_template.jinja`` from ``model_dir``.

        Raises :class:`CheckpointError` when ``tokenizer.json`` is missing or any of these files is malformed.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"no tokenizer.json in {model_dir}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust binding raises a bare Exception for malformed files
            raise CheckpointError(f"cannot load {path}: {err}") from None
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(model_dir / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # transformers reads the legacy map only for older configs
            config |= _read_json(model_dir / "special_tokens_map.json")
        _add_configured_tokens(backend, config)
        template_file = model_dir / "chat_template.jinja"  # transformers prefers it to the config's entry
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        return cls(backend, config, _read_json(model_dir / "generation_config.json"),
                   template if isinstance(template, str) else None)

    def backend_json(self) -> str:
        """The backend's ``tokenizer.json`` text, with the added tokens loaded beside it (a grammar library's
        token index is built from it)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (vocabulary or added token), or ``None`` if unknown."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's tokens (e.g. BOS) are included."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids at or above ``vocab_size`` (padded embedding rows) decode to nothing, as in
        transformers; negative ids raise :class:`TokenOutOfVocabError`."""
        if ids and min(ids) < 0:
            raise TokenOutOfVocabError(f"negative token id {min(ids)}")
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def encode_with_images(self, text: str, *, image_token: str, image_token_id: int,
                           tokens_per_image: int) -> tuple[list[int], int]:
        """Ids of a prompt whose ``image_token`` placeholders each become ``tokens_per_image`` ``image_token_id``s.

        When ``image_token`` is an added token of the tokenizer, the ids equal transformers' ``LlavaProcessor``
        (expand the text, then tokenize). Otherwise the text between placeholders is tokenized piece by piece and the
        special tokens go around the whole prompt only. Returns ``(ids, number_of_images)``. Raises
        :class:`InvalidRequestError` for an empty placeholder or ``tokens_per_image < 1`` and
        :class:`CheckpointError` when ``image_token_id`` is not the tokenizer's id for ``image_token``.
        """
        if not image_token or tokens_per_image < 1:
            raise InvalidRequestError(f"bad image placeholder {image_token!r} x {tokens_per_image}")
        image_ids = [image_token_id] * tokens_per_image
        if image_token in self._added:
            if self.token_to_id(image_token) != image_token_id:
                raise CheckpointError(f"{image_token!r} has id {self.token_to_id(image_token)}, not {image_token_id}")
            # An added token is split out before tokenization, so expanding its id equals expanding the text.
            encoded = self.encode(text)
            ids: list[int] = []
            for token_id in encoded:
                ids.extend(image_ids if token_id == image_token_id else (token_id,))
            return ids, encoded.count(image_token_id)
        pieces = text.split(image_token)
        body = self.encode(pieces[0], add_special_tokens=False) if pieces[0] else []
        for piece in pieces[1:]:
            body += image_ids + (self.encode(piece, add_special_tokens=False) if piece else [])
        return self._prefix_ids + body + self._suffix_ids, len(pieces) - 1

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str | None:
        """Render ``messages`` with the checkpoint's chat template the way transformers does (sandboxed jinja2,
        ``trim_blocks``/``lstrip_blocks``, special tokens as variables). Returns ``None`` when the checkpoint has no
        template or jinja2 is not installed; a template error raises :class:`InvalidRequestError`. ``tools``
        (OpenAI function tools) is the template's ``tools`` variable, as transformers passes it."""
        if self.chat_template is None:
            return None
        try:
            import jinja2
        except ImportError:
            return None
        try:
            return self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self._special)
        except jinja2.TemplateError as err:
            raise InvalidRequestError(f"chat template failed: {err}") from None

    def _compiled_template(self):
        """The chat template compiled once per template text (compiling it took ~2 ms a request on the Qwen3-VL
        template, most of the render); a template that fails to compile raises each time it is used."""
        import jinja2.ext
        import jinja2.sandbox

        cached = self.__dict__.get("_template_cache")
        if cached is not None and cached[0] == self.chat_template:
            return cached[1]
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        self._template_cache = (self.chat_template, template)  # one tuple: a reader never sees half an update
        return template


class IncrementalDetokenizer:
    """Streams the text of generated ids as deltas, decoding only a few ids per step (as vLLM's detokenizer).

    Each :meth:`push` decodes the window from ``prefix_offset`` (a few ids whose text was already emitted, kept as
    context for decoders that depend on the previous token: leading spaces, byte-level merges) to the end, and emits
    what it adds beyond the text of the already-emitted part. Text ending in U+FFFD (a UTF-8 sequence split across
    tokens) is held back until later ids complete it, or until :meth:`finish`. With no ``prompt_ids``, the deltas
    concatenate to ``tokenizer.decode(all_ids)``; with them, the first delta carries the spacing that follows the
    prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 context: int = 5):
        """Stream ids generated after ``prompt_ids``, of which only the last ``context`` are kept as context."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[len(prompt_ids) - context:] if len(prompt_ids) > context else prompt_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids``; return the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text, new_text = self._window()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # Drop ids no longer needed as context so every step stays O(window).
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text):]

    def finish(self) -> str:
        """Text still held back (e.g. an incomplete UTF-8 sequence at the end); call once, after the last push."""
        prefix_text, new_text = self._window()
        self._ids.clear()
        self._prefix_offset = self._read_offset = 0
        return new_text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        """Text of the emitted context ids and of the whole window."""
        decode = self._tokenizer.decode
        return (decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip),
                decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip))


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, ``{}`` when absent; :class:`CheckpointError` when unreadable or not an object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    """A token given as a string or as a serialized ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_token_strings(config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens (``bos_token`` ...) and model-specific ``*_token`` strings (e.g. ``image_token``)."""
    named = {key: _token_str(config.get(key)) for key in _NAMED_SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens")
    model_specific = {k: v for k, v in config.items()
                      if k.endswith("_token") and k not in named and isinstance(v, str)}
    model_specific |= {k: _token_str(v) for k, v in extra.items()} if isinstance(extra, dict) else {}
    return {k: v for k, v in (named | model_specific).items() if v}


def _add_configured_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Add the tokens transformers adds on load: saved added tokens missing from ``tokenizer.json``, then every
    named, model-specific and extra special token (as special, unnormalized tokens)."""
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    saved = config.get("added_tokens_decoder") or {}
    try:
        missing = [AddedToken(**{k: v for k, v in saved[i].items() if k in _ADDED_TOKEN_FIELDS})
                   for i in sorted(saved, key=int) if saved[i].get("content") not in present]
    except (TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"malformed added_tokens_decoder in tokenizer_config.json: {err}") from None
    backend.add_tokens(missing)
    lists = [config.get(key) for key in ("extra_special_tokens", "additional_special_tokens")]
    extra = [_token_str(token) for tokens in lists if isinstance(tokens, list) for token in tokens]
    special = [*_special_token_strings(config).values(), *filter(None, extra)]
    backend.add_special_tokens([AddedToken(token, special=True) for token in dict.fromkeys(special)])


def _special_affixes(backend: tokenizers.Tokenizer, added: set[str]) -> tuple[list[int], list[int]]:
    """Ids the post-processor puts before and after a single sequence, found by post-processing a probe."""
    for probe in (*sorted(added), "a", " ", "0"):
        encoding = backend.encode(probe, add_special_tokens=False)
        if encoding.ids:
            processed = backend.post_process(encoding)
            content = [i for i, seq in enumerate(processed.sequence_ids) if seq is not None]
            return processed.ids[: content[0]], processed.ids[content[-1] + 1:]
    return backend.encode("", add_special_tokens=True).ids, []


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop the spaces WordPiece-style decoders put before punctuation."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Chat templates' ``tojson`` filter as transformers defines it (no HTML escaping, json.dumps options)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    """``raise_exception`` for chat templates (they call it to reject unsupported roles and orders)."""
    import jinja2

    raise jinja2.TemplateError(message)
