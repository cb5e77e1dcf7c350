"""On a cluster of two nodes (ray.cluster_utils.Cluster: a head and a worker node on this machine), a job whose
outputs are a plain local path is refused before any work, naming each key: each node would keep only what its own
tasks wrote there. Object-store URIs pass, and so do local paths the config declares shared (every node mounts
them at the same place)."""

import pytest

pytestmark = pytest.mark.own_ray  # a cluster of two nodes instead of the shared Ray


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the shared local Ray (the next test that needs it starts it again)
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", cluster.address)  # jobs join it as they join any cluster
        patch.setenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")  # what joining sets; gone again after this module
        yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_a_training_job_with_local_outputs_is_refused_on_two_nodes_before_any_work(two_nodes, train_env):
    from pathlib import Path

    from tests.training.conftest import tiny_config
    from training.run import run_training

    cfg = tiny_config(train_env, "two-nodes")
    with pytest.raises(ValueError) as refused:
        run_training(cfg)
    message = str(refused.value)
    assert f"output_dir={cfg.output_dir}" in message and f"trainer.storage_path={cfg.trainer.storage_path}" in message
    assert "cluster of 2 nodes" in message and "shared_filesystem=true" in message and "s3://" in message
    assert not (Path(cfg.trainer.storage_path) / "two-nodes").exists()  # no worker group, no checkpoint


def test_uris_and_declared_shared_paths_pass_and_a_local_one_is_named(two_nodes, tmp_path):
    from runtime.local_ray import ray_session

    with ray_session(outputs={"trainer.storage_path": "s3://bucket/runs", "output_dir": str(tmp_path)},
                     shared_filesystem=True):
        pass
    with ray_session(outputs={"trainer.storage_path": "s3://bucket/runs"}):
        pass
    with pytest.raises(ValueError, match=r"^output_path=/data/out: a local path on a cluster of 2 nodes"):
        with ray_session(outputs={"output_path": "/data/out", "storage_path": "gs://bucket/x"}):
            pass


def test_a_training_job_with_every_path_on_object_storage_trains_across_both_nodes(two_nodes, train_env, s3):
    """The same job with its corpus, cache, checkpoints and export on object storage (the local S3 endpoint) runs
    on the two nodes: each node has one CPU and each worker takes one, so the two workers run on different nodes,
    each mapping corpus blocks the other node's tasks validated, and the Ray Data tasks of both write the cache.
    About 45 s: a two-worker run across the two nodes, its corpus, cache, checkpoints and export on the S3
    endpoint."""
    import math

    from storage.paths import storage_path
    from tests.training.conftest import TINY_NLI, tiny_config
    from training.run import run_training

    corpus = s3.upload(TINY_NLI, "nli/train.jsonl")
    result = run_training(tiny_config(
        train_env, "two-nodes-s3", f"data.train={corpus}", "data.cache=true", f"trainer.storage_path={s3.uri('runs')}",
        f"output_dir={s3.uri('models')}", "trainer.num_workers=2", "trainer.cpus_per_worker=1",
        "trainer.global_batch_size=16", "trainer.max_steps=2", "trainer.eval_every=2"))
    assert result["metrics"]["steps"] == 2 and math.isfinite(result["metrics"]["train_loss"])
    assert (result["rows_written"], result["corpus_cache"]) == (128, "written")
    assert result["checkpoint_path"] == s3.uri("runs/two-nodes-s3") and result["model_path"] == s3.uri(
        "models/two-nodes-s3/model")
    assert storage_path(result["model_path"]).joinpath("model.safetensors").exists()
    cached = [p for p in storage_path(s3.uri("runs/corpus_cache")).rglob("*.parquet")]
    assert cached and all(p.stat().st_size > 0 for p in cached)
