"""On a cluster of two nodes, the second with a disk and an environment of its own (tests/own_node.py: its own /tmp,
HOME and node cache, keys of its own and no AWS endpoint, region or profile), a job whose outputs are a plain local
path is refused before any work, naming each key: each node would keep only what its own tasks wrote there. Object-
store URIs pass, and so do local paths the config declares shared (every node mounts them at the same place); a job
with every path on object storage trains across both nodes, from a folder Spark wrote, with the driver's AWS profile
(a name in a file only the driver's machine has) never sent to the other node."""

import time

import pytest

pytestmark = pytest.mark.own_ray  # a cluster of two nodes instead of the shared Ray


@pytest.fixture(scope="module")
def two_nodes():
    """A head (ray.cluster_utils, in this process's environment) and a node of its own (own /tmp, HOME,
    environment), one CPU each. About 5 s."""
    import ray
    from ray.cluster_utils import Cluster

    from tests.own_node import OwnNode

    if ray.is_initialized():  # the shared local Ray (the next test that needs it starts it again)
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "node_ip_address": "127.0.0.1"})
    with OwnNode(cluster.address, num_cpus=1), pytest.MonkeyPatch.context() as patch:
        while sum(node["Alive"] for node in cluster.global_state.node_table()) < 2:
            time.sleep(0.2)
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
    assert "MLFLOW_TRACKING_URI=" in message  # the sqlite store: rank 0 on the other node would log to its own file
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


def _spark_folder(rows_file, folder):
    """The corpus as Spark writes ``df.write.parquet``: two snappy part files, checksums and commit markers."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    folder.mkdir(parents=True)
    for n, part in enumerate((rows[:len(rows) // 2], rows[len(rows) // 2:])):
        name = f"part-0000{n}-0e8b4f3a-c000.snappy.parquet"
        pq.write_table(pa.Table.from_pylist(part), folder / name, compression="snappy")
        (folder / f".{name}.crc").write_bytes(b"crc")
    for marker in ("_SUCCESS", "_started_42", "_committed_42"):
        (folder / marker).write_bytes(b"")
    return folder


def test_every_path_on_object_storage_trains_across_a_node_of_its_own_with_the_drivers_profile_unsent(
        two_nodes, train_env, s3, tmp_path, monkeypatch, request):
    """The job with its corpus (a folder Spark wrote), cache, checkpoints and export on object storage (the local S3
    endpoint) runs on the two nodes: each has one CPU and each worker takes one, so one worker runs on the node of
    its own, which reaches the endpoint only through what the job forwards and signs with its own keys. The driver
    uses an AWS profile from a file only it has: forwarded, the node's tasks failed with ProfileNotFound. The cache
    is written, read back, then its report torn: the next run validates again instead of failing. MLflow is a
    tracking server (a sqlite file is refused here: rank 0 may log from the other node). About 110 s: an MLflow
    server, two two-worker runs across the two nodes and a cached read."""
    import math

    from data_pipelines.readers import load_corpus
    from runtime.local_head import free_port
    from storage.paths import storage_path
    from tests.foundation.test_tracking_outage import start_server, stop
    from tests.training.conftest import TINY_NLI, tiny_config
    from training.run import run_training

    port = free_port()  # a tracking server every node reaches, as on a cluster: rank 0 logs its step metrics there
    server = start_server(port, tmp_path / "mlflow")
    request.addfinalizer(lambda: stop(server))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("RAOE_MLFLOW_ARTIFACTS", raising=False)  # the server keeps them
    aws = tmp_path / "driver-aws"
    aws.mkdir()
    (aws / "config").write_text("[profile laptop]\nregion = us-east-1\n")
    (aws / "credentials").write_text("[laptop]\naws_access_key_id = raoe-test\naws_secret_access_key = raoe-test\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(aws / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "laptop")
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")  # what MinIO needs: forwarded
    corpus = s3.upload(_spark_folder(TINY_NLI, tmp_path / "spark"), "nli/spark")

    def train(name):
        return run_training(tiny_config(
            train_env, name, f"data.train={corpus}", "data.cache=true", f"trainer.storage_path={s3.uri('runs')}",
            f"output_dir={s3.uri('models')}", "trainer.num_workers=2", "trainer.cpus_per_worker=1",
            "trainer.global_batch_size=16", "trainer.max_steps=2", "trainer.eval_every=2"))

    result = train("two-nodes-s3")
    assert result["metrics"]["steps"] == 2 and math.isfinite(result["metrics"]["train_loss"])
    assert (result["rows_written"], result["corpus_cache"]) == (128, "written")
    assert result["checkpoint_path"] == s3.uri("runs/two-nodes-s3") and result["model_path"] == s3.uri(
        "models/two-nodes-s3/model")
    assert storage_path(result["model_path"]).joinpath("model.safetensors").exists()
    cache = storage_path(s3.uri("runs/corpus_cache"))
    assert [p for p in cache.rglob("*.parquet")] and all(p.stat().st_size > 0 for p in cache.rglob("*.parquet"))
    ds, report = load_corpus("pairs", corpus, cache_dir=s3.uri("runs/corpus_cache"))
    assert report.cache == "read" and ds.count() == 128
    [torn] = [p for p in cache.rglob("report.json")]
    torn.write_text(torn.read_text()[:30])
    again = train("two-nodes-s3-torn")
    assert (again["rows_written"], again["corpus_cache"], again["metrics"]["steps"]) == (128, "written", 2)
