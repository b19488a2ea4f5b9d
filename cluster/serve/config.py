"""``duet serve``'s configuration: a YAML or JSON file of :class:`~cluster.control.spec.ClusterSpec` fields plus an optional
``serve:`` section (:class:`ServeConfig` fields, with ``limits:`` as :class:`~cluster.serve.limits.Limits`), then
command-line flags on top. Validated before anything starts; every problem is one :class:`ConfigError` line.

    model_dir: /models/llava-moe      # default: the shipped demo model
    num_prefill: 1
    num_decode: 2
    transport: gloo
    serve:
      host: 127.0.0.1
      grpc_port: 50051
      http_port: 8000
      model_name: llava-moe
      limits: {max_concurrent: 128, max_image_pixels: 4194304, max_visual_tokens: 16384}
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.control.spec import ClusterSpec
from cluster.serve.limits import Limits
from engine.errors import InvalidRequestError


class ConfigError(InvalidRequestError):
    """The serve configuration is unusable (the message names the field)."""


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0: a free port
    http_port: int = 8000  # 0: a free port
    token: str | None = None  # bearer token required on every call (gRPC metadata / HTTP header)
    insecure: bool = False  # allow a non-loopback bind without a token
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, both servers speak TLS only
    tls_key: str | None = None
    model_name: str | None = None  # the name clients use; default: the model directory's name
    drain_timeout_s: float = 30.0  # on shutdown, how long in-flight requests may take to finish
    limits: Limits = field(default_factory=Limits)
    # an autoscaling policy file (deploy/autoscaling/*.yaml; cluster.control.autoscale); in a config file a relative path is
    # relative to that file. None: fixed pool sizes
    autoscaling_policy: str | None = None

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be a port number (0-65535), got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both tls_cert and tls_key")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: no file at {path}")
        if self.token is not None and not self.token.strip():
            raise ConfigError("token must not be empty")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.autoscaling_policy is not None:
            from cluster.control.autoscale import PolicyError, load_policy

            try:
                load_policy(self.autoscaling_policy)
            except PolicyError as e:
                raise ConfigError(f"serve.autoscaling_policy: {e}") from None
        if not self.insecure and self.token is None and not is_loopback(self.host):
            raise ConfigError(f"refusing to serve on {self.host} (not a loopback address) without a token; "
                              "pass --token (and TLS) or --insecure")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_config_file(path: str | Path) -> dict:
    """The mapping in a ``.json``, ``.yaml`` or ``.yml`` file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{p}: cannot parse: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of settings")
    serve = data.get("serve")
    policy = serve.get("autoscaling_policy") if isinstance(serve, dict) else None
    if isinstance(policy, str) and not Path(policy).expanduser().is_absolute():
        serve["autoscaling_policy"] = str(p.parent / policy)  # relative to the config file, not the working dir
    return data


def build_configs(data: dict, overrides: dict[str, Any], default_model_dir: str) -> tuple[ClusterSpec, ServeConfig]:
    """The cluster spec and serve config from a config mapping, with ``overrides`` (non-None command-line values
    for ServeConfig fields, or ``model_dir``) on top."""
    data = dict(data)
    serve = data.pop("serve", None) or {}
    if not isinstance(serve, dict):
        raise ConfigError("serve: must be a mapping")
    limits = serve.pop("limits", None) or {}
    if not isinstance(limits, dict):
        raise ConfigError("serve.limits: must be a mapping")
    if overrides.get("model_dir") is not None:
        data["model_dir"] = overrides.pop("model_dir")
    overrides.pop("model_dir", None)
    data.setdefault("model_dir", default_model_dir)
    serve.update({k: v for k, v in overrides.items() if v is not None})
    limits_obj = Limits(**_checked(Limits, limits, "serve.limits"))
    serve_cfg = ServeConfig(**_checked(ServeConfig, serve, "serve", skip={"limits"}), limits=limits_obj)
    data["model_dir"] = str(data["model_dir"])
    spec = ClusterSpec(**_checked(ClusterSpec, data, ""))
    return spec, serve_cfg


def _checked(cls: type, values: dict, section: str, skip: frozenset[str] | set[str] = frozenset()) -> dict:
    """``values`` after checking every key is a field of ``cls`` and every value has the field's simple type."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    prefix = f"{section}." if section else ""
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown setting {prefix}{key} (known: {', '.join(names)})")
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{prefix}{key}: expected {_type_name(hints[key])}, got {value!r}")
    return values


def _options(hint: Any) -> tuple:
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return tuple(typing.get_origin(t) or t for t in (typing.get_args(hint) if union else (hint,)))


def _type_ok(value: Any, hint: Any) -> bool:
    for t in _options(hint):
        if t is type(None) and value is None:
            return True
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t in (str, bool, dict, list) and isinstance(value, t):
            return True
    return False


def _type_name(hint: Any) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in _options(hint))
