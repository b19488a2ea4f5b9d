"""deploy/serve/*.yaml load through `duet serve --config`'s loader (cluster.serve.config) and the new placement
and autoscaling fields are validated with clear errors. Nothing is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.control.autoscale import Policy
from cluster.control.spec import ClusterSpec
from cluster.serve.config import ConfigError, build_configs, read_config_file
from engine.errors import InvalidRequestError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE = sorted((DEPLOY / "serve").glob("*.yaml"))


def load(path: Path, model_dir: Path, token: str | None = None):
    """As `duet serve --config PATH --model-dir MODEL_DIR [--token TOKEN]` would (the configs name checkpoints on
    the cluster)."""
    return build_configs(read_config_file(path), {"model_dir": str(model_dir), "token": token}, str(model_dir))


def test_there_are_serve_configs() -> None:
    assert {p.stem for p in SERVE} >= {"default", "gpu-2p4d", "compressed-grpc"}


@pytest.mark.parametrize("path", SERVE, ids=lambda p: p.stem)
def test_serve_config_loads(path: Path, tiny_model_dir: Path) -> None:
    spec, cfg = load(path, tiny_model_dir, token="t0ken")  # the GPU configs bind 0.0.0.0: --token "$DUET_TOKEN"
    assert spec.num_prefill >= 1 and spec.num_decode >= 1
    if cfg.autoscaling_policy is not None:
        from cluster.control.autoscale import load_policy

        assert isinstance(load_policy(cfg.autoscaling_policy), Policy)
    if spec.gpus_per_worker > 0:  # GPU configs pin each pool to its nodes
        assert spec.actor_options("prefill")["resources"] == {"duet_prefill": 1}
        assert spec.actor_options("decode")["resources"] == {"duet_decode": 1}


def test_policy_path_is_relative_to_the_config_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "p.yaml").write_text((DEPLOY / "autoscaling" / "default.yaml").read_text())
    cfgfile = tmp_path / "serve.yaml"
    cfgfile.write_text("serve:\n  autoscaling_policy: sub/p.yaml\n")
    _, cfg = load(cfgfile, tiny_model_dir)
    assert Path(cfg.autoscaling_policy) == tmp_path / "sub" / "p.yaml"


def test_bad_policy_is_a_config_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "p.yaml").write_text("prefill: {min_workers: 0}\ndecode: {}\n")
    cfgfile = tmp_path / "serve.yaml"
    cfgfile.write_text("serve:\n  autoscaling_policy: p.yaml\n")
    with pytest.raises(ConfigError, match=r"serve\.autoscaling_policy: .*p\.yaml: prefill\.min_workers"):
        load(cfgfile, tiny_model_dir)
    cfgfile.write_text("serve:\n  autoscaling_policy: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="autoscaling policy not found"):
        load(cfgfile, tiny_model_dir)


def test_actor_options_default_has_no_custom_resources(tiny_model_dir: Path) -> None:
    spec = ClusterSpec(str(tiny_model_dir))
    assert spec.actor_options("decode") == {"num_cpus": 1.0, "num_gpus": 0.0}


@pytest.mark.parametrize(("resources", "message"), [
    ({"duet_prefill": 0}, r"prefill_resources\.duet_prefill must be a positive number"),
    ({"GPU": 1}, "GPU is set by cpus_per_worker / gpus_per_worker"),
    ({"duet_prefill": "one"}, "must be a positive number"),
], ids=["zero", "gpu", "string"])
def test_bad_pool_resources(resources: dict, message: str, tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        ClusterSpec(str(tiny_model_dir), prefill_resources=resources)


def test_pool_resources_must_be_a_mapping_in_a_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfgfile = tmp_path / "serve.yaml"
    cfgfile.write_text("decode_resources: duet_decode\n")
    with pytest.raises(ConfigError, match="decode_resources: expected dict or null"):
        load(cfgfile, tiny_model_dir)
