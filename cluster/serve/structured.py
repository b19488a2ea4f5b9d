"""OpenAI ``response_format`` -> :class:`~engine.grammar_spec.StructuredOutputsParams`, checked before anything is
reserved.

``{"type": "text"}`` (or none): free text. ``{"type": "json_object"}``: any JSON object. ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``: JSON valid under ``schema`` (always enforced, ``strict`` or not). The
grammar is compiled here once (:func:`engine.grammar.validate`, about a millisecond for a small schema), so a schema
that does not compile is a 400 before the request reaches a worker; the workers compile it again from the spec
carried in the request's sampling parameters (prefill and decode each build their own matcher).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import validate
from engine.grammar_spec import StructuredOutputsParams


def response_format_spec(fmt: Any) -> StructuredOutputsParams | None:
    """The structured-outputs spec of a ``response_format`` value (None for free text); raises
    :class:`~engine.errors.InvalidRequestError` (a :class:`~engine.grammar.GrammarError` when it does not
    compile) naming the field."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        spec = StructuredOutputsParams(json_object=True)
    elif kind == "json_schema":
        js = fmt.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("'response_format.json_schema.schema' must be a JSON Schema object")
        for field, kind_ in (("name", str), ("strict", bool)):  # as the API description types them (or null)
            if js.get(field) is not None and not isinstance(js[field], kind_):
                raise InvalidRequestError(f"'response_format.json_schema.{field}' must be a "
                                          f"{'string' if kind_ is str else 'boolean'} or null")
        spec = StructuredOutputsParams(json=schema)
    else:
        raise InvalidRequestError("'response_format.type' must be one of text, json_object, json_schema")
    checked(spec)
    return spec


def checked(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """``spec`` once it compiles (raises :class:`~engine.grammar.GrammarError`, a 400, when it does not)."""
    validate(spec)
    return spec
