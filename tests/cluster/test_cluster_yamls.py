"""Every cluster-launcher YAML passes Ray's own schema validation; KubeRay manifests have the fields KubeRay needs."""

import copy
from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
LAUNCHER = sorted(CLUSTER.glob("*.yaml"))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_yaml_passes_rays_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    commands = " ".join(config.get("head_start_ray_commands", []))
    assert "RAY_USAGE_STATS_ENABLED=0" in commands and "--dashboard-host=127.0.0.1" in commands


def test_the_validation_rejects_a_misspelt_key():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CLUSTER / "local.yaml").read_text())
    config["max_worker"] = config.pop("max_workers")
    with pytest.raises(Exception, match="max_worker"):
        validate_config(prepare_config(config))


def test_there_is_a_gpu_cluster_a_workstation_and_the_local_default():
    names = {p.name for p in LAUNCHER}
    assert {"aws-a100.yaml", "rtx4090-workstation.yaml", "local.yaml"} <= names
    gpu = yaml.safe_load((CLUSTER / "aws-a100.yaml").read_text())["available_node_types"]
    assert any(t["resources"].get("GPU", 0) >= 4 for t in gpu.values())


@pytest.mark.parametrize("path", sorted((CLUSTER / "kuberay").glob("*.yaml")), ids=lambda p: p.name)
def test_kuberay_manifest_shape(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == "2.60.0"
    workers = spec["workerGroupSpecs"]
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for w in workers for c in w["template"]["spec"]["containers"]]
    assert "4" in gpus
    if doc["kind"] == "RayJob":
        assert "ray_jobs/stage1.py" in doc["spec"]["entrypoint"]
