"""Elastic training loses a node: a tiny Stage 1 job with ``trainer.num_workers: [1, 2]`` on a two-node local cluster
(one CPU each, one worker per node) loses the second node after step 3 (the workers held there until it is gone:
training.faults.PauseAfterStep); Ray Train restarts the group from the last
checkpoint on the one worker left, and the run ends with the losses of an uninterrupted one-worker run (the same
chunks, so the same dropout masks). Marker ``reliability``: about 2 minutes, in its own process and cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability
ROOT = Path(__file__).resolve().parents[2]
# both nodes of the local cluster are this machine: its disk is a file system every node mounts at the same path
COMMON = ("data.max_rows=120", "trainer.global_batch_size=32", "trainer.max_steps=6", "trainer.eval_every=1",
          "trainer.lr=1e-3", "model.dropout=0.1", "trainer.chunk_size=8", "trainer.cpus_per_worker=1.0",
          "shared_filesystem=true")


def scenario(root: str) -> None:
    """Run in a fresh process: the reference and the elastic run, their per-step losses and group sizes to JSON."""
    import ray
    from ray.cluster_utils import Cluster

    from runtime.local_ray import apply_safe_local_env, worker_env
    from tests.training.conftest import metric_by_step, tiny_config
    from training.faults import PauseAfterStep
    from training.run import run_training

    root = Path(root)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(root / "artifacts")
    apply_safe_local_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": True,
                                                              "dashboard_host": "127.0.0.1"})
    node = cluster.add_node(num_cpus=1)
    # the controller's first try for 2 workers after the loss waits this long (Ray's default 60 s)
    ray.init(address=cluster.address,
             runtime_env={"env_vars": {**worker_env(), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}})
    try:
        reference = run_training(tiny_config(root, "uninterrupted", *COMMON, "trainer.num_workers=1"))
        threading.Thread(target=_remove_after, args=(cluster, node, "elastic", 3), daemon=True).start()
        started = time.time()
        # the workers wait after step 3 until the node is gone (a tiny step takes ~0.1 s: the run would end first)
        elastic = run_training(tiny_config(root, "elastic", *COMMON, "trainer.num_workers=[1, 2]",
                                           "trainer.max_failures=3"), after_step=(PauseAfterStep(3, 60.0),))
        out = {"seconds": time.time() - started,
               "reference": metric_by_step(reference["run_id"], "train_loss"),
               "elastic": metric_by_step(elastic["run_id"], "train_loss"),
               "workers": metric_by_step(elastic["run_id"], "workers")}
        (root / "result.json").write_text(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _remove_after(cluster, node, run_name: str, step: int) -> None:
    """Once MLflow shows ``step`` logged for the run, take the second node away (as a preempted VM goes)."""
    from mlflow import MlflowClient

    client, deadline = MlflowClient(), time.time() + 600
    while time.time() < deadline:
        experiment = client.get_experiment_by_name("raoe-test")
        runs = client.search_runs([experiment.experiment_id], f"tags.`mlflow.runName` = '{run_name}'") \
            if experiment else []
        if runs and any(m.step >= step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")):
            time.sleep(3)  # the step's checkpoint reported
            cluster.remove_node(node)
            return
        time.sleep(0.2)


def test_an_elastic_run_that_loses_a_node_ends_with_the_uninterrupted_losses(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", f"from tests.reliability.test_elastic import scenario; "
                                          f"scenario({str(tmp_path)!r})"], cwd=ROOT, env=env, timeout=900, check=True)
    result = json.loads((tmp_path / "result.json").read_text())
    workers = {int(k): v for k, v in result["workers"].items()}
    assert workers[1] == 2 and workers[6] == 1, workers  # two workers first, one after the node went
    reference, elastic = result["reference"], result["elastic"]
    assert sorted(elastic) == sorted(reference) == [str(s) for s in range(1, 7)]
    for step in reference:
        # the same chunks and masks on 2 workers and on 1: equal to float summation order
        assert elastic[step] == pytest.approx(reference[step], rel=1e-5), f"loss at step {step}"
