"""The model-family registry: a checkpoint's ``model_type`` -> the family package under :mod:`engine.models` that
parses, builds and loads it.

A family package ``engine/models/<name>/`` holds its config parsing, modules and checkpoint-key mapping; its
``family.py`` exports ``FAMILY``, an object of the :class:`engine.config.ModelFamily` protocol. Adding a family is
its folder plus one line of :data:`_FAMILIES`, naming the ``model_type`` values it serves: ``config.json``'s top-level
ones and its text configs' ones.

Families are imported on first use by name (as :mod:`kv_transfer.registry` loads transports): every family imports
:mod:`engine.config`, which looks families up here, so nothing below a family ever imports one.
"""

from __future__ import annotations

from engine.errors import UnsupportedModelError
from engine.text_config import DECODER_MODELS

# family package -> (the config.json model_types it serves, the text-config model_types it serves)
_FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llava": (("llava", *DECODER_MODELS), DECODER_MODELS),  # a bare decoder is a LLaVA without a tower
    "qwen3_vl": (("qwen3_vl_moe", "qwen3_vl"), ("qwen3_vl_moe_text", "qwen3_vl_text")),
    "qwen3_5": (("qwen3_5_moe", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5_text")),
}
_MODELS = {mt: family for family, (types, _) in _FAMILIES.items() for mt in types}
_TEXT_MODELS = {mt: family for family, (_, types) in _FAMILIES.items() for mt in types}
MODEL_TYPES: tuple[str, ...] = tuple(_MODELS)
TEXT_MODEL_TYPES: tuple[str, ...] = tuple(_TEXT_MODELS)


def family_module(model_type: object, *, text: bool = False) -> str:
    """The module (``engine.models.<family>.family``) of the family serving ``model_type``: a ``config.json``'s, or
    with ``text`` a text config's. Raises :class:`UnsupportedModelError` for any other value."""
    table = _TEXT_MODELS if text else _MODELS
    family = table.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        kind = "text model_type" if text else "model_type"
        raise UnsupportedModelError(f"unsupported {kind} {model_type!r} (supported: {', '.join(table)})")
    return f"engine.models.{family}.family"
