"""A cluster as cluster/*.yaml and KubeRay start it: a head that runs no tasks (`ray start --head --num-cpus 0`) and a
worker node that joins after the job has started, as an autoscaler adds one, with a disk and an environment of its
own (tests/own_node.py). The job is submitted the user's way (`ray job submit --working-dir .`) to a head in a temp
dir of its own, while another Ray, started on this machine after the head, is the newest in Ray's default one."""

import json
from pathlib import Path

import pytest
import ray

from runtime.local_head import LocalHead, free_port, head_env
from tests.foundation.test_tracking_outage import start_server, stop
from tests.own_node import OwnNode

pytestmark = pytest.mark.own_ray  # a head of its own and a node that joins it, in place of the shared Ray

ROOT = Path(__file__).resolve().parents[2]


def _result(lines: list[str]) -> dict:
    return json.loads(next(line for line in reversed(lines) if line.startswith('{"job"')))


def test_a_head_without_cpus_refuses_local_paths_and_trains_on_a_node_that_joins_later(tmp_path, s3, request):
    """Before, the job counted the nodes alive at submit (one: the head) and took a local output_dir, then waited for
    a node to write to. Now any cluster whose tasks may run on another machine refuses local inputs and outputs
    before any work, naming the keys; with every path on s3:// the job runs once a node joins. About 120 s on 2
    cores: an MLflow server, a head of its own, a refused submission, then a two-step Stage 1 run on a node that
    joins mid-job."""
    if ray.is_initialized():
        ray.shutdown()
    server = start_server(port := free_port(), tmp_path / "mlflow")  # every node reaches it (rank 0 logs there)
    request.addfinalizer(lambda: stop(server))
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "RAOE_HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1"}
    clean = head_env()
    for key in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS", "RAOE_HOME", "RAY_ADDRESS"):
        clean.pop(key, None)
    corpus = s3.upload(ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl", "nli/train.jsonl")
    stage1 = ["python", "ray_jobs/stage1.py", "--config", "configs/tiny/stage1.yaml", "--set", "trainer.max_steps=2",
              "--set", "trainer.eval_every=2", "--set", "tracking.experiment=raoe-autoscaled"]
    with LocalHead(clean, num_cpus=0) as head:
        ray.init(address="local", num_cpus=1, include_dashboard=False)  # the newest Ray in /tmp/ray now
        try:
            refused = list(head.submit([*stage1, "--set", f"data.train={str(ROOT / 'configs/tiny/data/nli_pairs.jsonl')}"],
                                       {"env_vars": env}, cwd=ROOT))
        finally:
            ray.shutdown()
        message = _result(refused)["error"]
        assert head.returncode != 0 and "runs no tasks (CPU: 0)" in message, "".join(refused[-20:])
        for key in ("output_dir=", "trainer.storage_path=", "data.train="):
            assert key in message
        assert not list((tmp_path / "home").rglob("*.safetensors")) and not list((tmp_path / "home").rglob("*.parquet"))

        lines, node = [], None
        try:
            for line in head.submit([*stage1, "--set", f"data.train={corpus}",
                                     "--set", f"trainer.storage_path={s3.uri('runs')}",
                                     "--set", f"output_dir={s3.uri('models')}"], {"env_vars": env}, cwd=ROOT):
                lines.append(line)
                if node is None and "[raoe]" in line:  # the job's driver runs, and waits for CPUs: a node joins
                    node = OwnNode(head.gcs_address, num_cpus=2).__enter__()
        finally:
            if node is not None:
                node.__exit__(None, None, None)
    assert node is not None and head.returncode == 0, "".join(lines[-30:])
    result = _result(lines)
    assert (result["rows_written"], result["corpus_cache"], result["metrics"]["steps"]) == (128, "written", 2)
    assert result["model_path"].startswith(s3.uri("models/"))
