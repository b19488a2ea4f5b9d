"""deploy/ray/*.yaml pass the validation `ray up` runs before it calls any cloud (prepare_config, then
validate_config against ray/autoscaler/ray-schema.json), and deploy/kuberay/raycluster.yaml has the RayCluster
fields a KubeRay operator needs. No cloud or Kubernetes calls."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP = sorted((DEPLOY / "ray").glob("*.yaml"))
POOLS = {"duet_prefill", "duet_decode"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def ray_up_check(config: dict) -> dict:
    """What `ray up` does to a config before it bootstraps the provider (ray.autoscaler._private.commands)."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_there_are_aws_gcp_and_onprem_configs() -> None:
    assert {p.stem for p in RAY_UP} >= {"aws", "gcp", "onprem"}


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.stem)
def test_ray_up_accepts_the_config(path: Path) -> None:
    prepared = ray_up_check(load(path))
    assert prepared["setup_commands"] and any("torch" in c and "cu" in c for c in prepared["setup_commands"])
    assert any("-e ~/duet " in c for c in prepared["setup_commands"])


@pytest.mark.parametrize("path", [p for p in RAY_UP if p.stem != "onprem"], ids=lambda p: p.stem)
def test_cloud_configs_have_separate_gpu_pools(path: Path) -> None:
    cfg = load(path)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not POOLS & set(head["resources"]) and not head["resources"].get("GPU")
    for pool in POOLS:
        (name, node), = [(n, t) for n, t in types.items() if pool in t["resources"]]
        assert node["resources"]["GPU"] >= 1 and node["resources"][pool] == node["resources"]["GPU"], name
        assert not (POOLS - {pool}) & set(node["resources"]), f"{name} is in both pools"
        assert 0 <= node.get("min_workers", 0) <= node["max_workers"] <= cfg["max_workers"]


def test_onprem_workers_declare_their_pool() -> None:
    cfg = load(DEPLOY / "ray" / "onprem.yaml")
    assert cfg["provider"]["type"] == "local"
    start = " ".join(cfg["worker_start_ray_commands"])
    assert "duet_$POOL" in start and "--resources" in start


def test_the_validation_is_not_vacuous() -> None:
    cfg = load(DEPLOY / "ray" / "aws.yaml")
    cfg["available_node_types"]["decode_gpu"]["resources"]["GPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        ray_up_check(cfg)
    cfg = load(DEPLOY / "ray" / "aws.yaml")
    cfg["head_node_type"] = "nope"
    with pytest.raises(ValueError, match="head_node_type"):
        ray_up_check(cfg)


# ------------------------------------------------------------------------------------------------------ KubeRay
def test_kuberay_raycluster_has_the_crd_fields() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()) if d]
    (rc,) = [d for d in docs if d.get("kind") == "RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"]
    spec = rc["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["template"]["spec"]["containers"][0]["image"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, g in groups.items():
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())  # the CRD types them as strings
        # KubeRay passes resources through to `ray start --resources`: a quoted JSON object
        resources = json.loads(json.loads(g["rayStartParams"]["resources"]))
        (container,) = g["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert resources == {f"duet_{name}": gpus} and container["image"]
    assert spec.get("enableInTreeAutoscaling") is True
