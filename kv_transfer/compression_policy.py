"""KV compression policies (what :mod:`kv_transfer.compression`'s ``modal`` codec does per modality): a
:class:`Method` per section (text, visual) -- ``raw``, ``fp8`` or ``int`` with bits, group and kept K/V channel
fractions -- plus the share of visual tokens kept; the named ``default`` and ``aggressive`` policies; and
:func:`resolve_policy` from a name, JSON or dict. Every field is validated (:class:`InvalidPolicy`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

POLICY_VERSION = 1
METHODS = ("raw", "fp8", "int")
INT_BITS = (4, 8)
SECTIONS = ("text", "visual")

DEFAULT_VISUAL_BITS, DEFAULT_VISUAL_GROUP = 8, 64
# group 64, not 32: at 36 visual tokens per image the float16 scales of 32-groups cost 0.9 bits a value and the
# ratio to float32 falls to 6.8x; on the demo model 64-groups keep the same agreement and accuracy (bench kv-codec)
AGGRESSIVE_VISUAL_BITS, AGGRESSIVE_VISUAL_GROUP, AGGRESSIVE_VISUAL_KEEP_K = 4, 64, 0.75


class InvalidPolicy(ValueError):
    """A compression policy spec with a bad field; the one-line message names the field and the allowed values."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ratio(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidPolicy(f"{field} must be a number in (0, 1], got {value!r}")


def check_method(kind: Any, bits: Any, group: Any, keep_k: Any, keep_v: Any, where: str) -> None:
    if kind not in METHODS:
        raise InvalidPolicy(f"{where}.kind must be one of {list(METHODS)}, got {kind!r}")
    if not (is_int(bits) and bits in INT_BITS) if kind == "int" else bits is not None:
        raise InvalidPolicy(f"{where}.bits must be one of {list(INT_BITS)} for kind 'int' and None otherwise, "
                            f"got {bits!r}")
    if not (is_int(group) and group >= 1) if kind == "int" else group is not None:
        raise InvalidPolicy(f"{where}.group must be an int >= 1 for kind 'int' and None otherwise, got {group!r}")
    _check_ratio(keep_k, f"{where}.keep_k")
    _check_ratio(keep_v, f"{where}.keep_v")


def _check_keys(d: Any, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise InvalidPolicy(f"{where} must be a JSON object / dict, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed), key=str)
    if unknown:
        raise InvalidPolicy(f"{where} has unknown field {unknown[0]!r} (allowed: {list(allowed)})")


@dataclass(frozen=True)
class Method:
    """How one modality's K and V travel. ``bits`` (4 | 8) and ``group`` (>= 1) are for ``kind="int"`` only;
    ``keep_k``/``keep_v`` in (0, 1] are the fractions of channels kept per KV head (1.0: no pruning)."""

    kind: str = "raw"
    bits: int | None = None
    group: int | None = None
    keep_k: float = 1.0
    keep_v: float = 1.0

    def __post_init__(self) -> None:
        check_method(self.kind, self.bits, self.group, self.keep_k, self.keep_v, "Method")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Method:
        """Raises :class:`InvalidPolicy` naming ``where.<field>``."""
        _check_keys(d, ("kind", "bits", "group", "keep_k", "keep_v"), where)
        fields = {**asdict(cls()), **d}
        check_method(**fields, where=where)
        return cls(**fields)


@dataclass(frozen=True)
class CompressionPolicy:
    """Per-modality methods plus FastV-style visual-token dropping (``keep_visual_tokens`` in (0, 1]).

    Crosses processes as ``to_dict()`` (msgpack-able, with ``"version"``).
    """

    name: str
    text: Method
    visual: Method
    keep_visual_tokens: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidPolicy(f"policy.name must be a non-empty str, got {self.name!r}")
        for field in ("text", "visual"):
            if not isinstance(getattr(self, field), Method):
                raise InvalidPolicy(f"policy.{field} must be a Method, got {type(getattr(self, field)).__name__}")
        _check_ratio(self.keep_visual_tokens, "policy.keep_visual_tokens")

    def to_dict(self) -> dict[str, Any]:
        return {"version": POLICY_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Any) -> CompressionPolicy:
        """Inverse of :meth:`to_dict` (``text``/``visual`` default to raw); raises :class:`InvalidPolicy`."""
        _check_keys(d, ("version", "name", "text", "visual", "keep_visual_tokens"), "policy")
        if d.get("version") != POLICY_VERSION:
            raise InvalidPolicy(f"policy.version must be {POLICY_VERSION}, got {d.get('version')!r}")
        return cls(name=d.get("name"), text=Method.from_dict(d.get("text", {}), "policy.text"),
                   visual=Method.from_dict(d.get("visual", {}), "policy.visual"),
                   keep_visual_tokens=d.get("keep_visual_tokens", 1.0))


DEFAULT = CompressionPolicy("default", text=Method("raw"),
                            visual=Method("int", bits=DEFAULT_VISUAL_BITS, group=DEFAULT_VISUAL_GROUP))
AGGRESSIVE = CompressionPolicy("aggressive", text=Method("fp8"),
                               visual=Method("int", bits=AGGRESSIVE_VISUAL_BITS, group=AGGRESSIVE_VISUAL_GROUP,
                                             keep_k=AGGRESSIVE_VISUAL_KEEP_K))
POLICIES: dict[str, CompressionPolicy | None] = {"none": None, "default": DEFAULT, "aggressive": AGGRESSIVE}


def resolve_policy(spec: None | str | dict[str, Any] | CompressionPolicy) -> CompressionPolicy | None:
    """A policy from a name (``none`` / ``default`` / ``aggressive``), a JSON object string, a dict (``version``
    and ``name`` optional) or a policy; None for no compression. Raises :class:`InvalidPolicy`."""
    if spec is None or isinstance(spec, CompressionPolicy):
        return spec
    if isinstance(spec, str):
        if not spec.lstrip().startswith("{"):
            if spec not in POLICIES:
                raise InvalidPolicy(f"policy must be one of {list(POLICIES)} or a JSON object, got {spec!r}")
            return POLICIES[spec]
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidPolicy(f"policy JSON does not parse: {e}") from None
    if not isinstance(spec, dict):
        raise InvalidPolicy(f"policy must be None, a name, a JSON object, a dict or a CompressionPolicy, "
                            f"got {type(spec).__name__}")
    return CompressionPolicy.from_dict({"version": POLICY_VERSION, "name": "custom", **spec})


def needs_scores(policy: CompressionPolicy) -> bool:
    """Whether ``policy`` prunes channels or drops tokens, i.e. whether :class:`CodecContext` scores matter."""
    methods = (policy.text, policy.visual)
    return policy.keep_visual_tokens < 1 or any(m.keep_k < 1 or m.keep_v < 1 for m in methods)
