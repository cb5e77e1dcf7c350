"""Nothing a job writes may live in Ray's scratch copy of its working dir: relative outputs and the default MLflow
store resolve under RAOE_HOME there, an absolute path into the copy is refused, and artifacts sit beside a sqlite
store's file."""

import pytest


@pytest.fixture
def in_ray_copy(tmp_path, monkeypatch):
    copy = tmp_path / "ray" / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("RAOE_HOME", str(tmp_path / "home"))
    for name in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS"):  # setenv first: teardown restores what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return copy


def test_relative_outputs_resolve_under_raoe_home_inside_a_ray_copy(in_ray_copy, tmp_path):
    from jobconfig import ConfigError, load_config
    from jobconfig.schema import TrainJobConfig
    from runtime.paths import stable_path
    from runtime.tracking_store import artifact_root, tracking_uri

    home = tmp_path / "home"
    assert stable_path("outputs/models") == str(home / "outputs" / "models")
    cfg = load_config(TrainJobConfig, None, [])
    assert cfg.output_dir == str(home / "outputs" / "models") and cfg.trainer.storage_path == str(home / "raoe_runs")
    assert tracking_uri() == f"sqlite:///{home / 'mlflow.db'}" and artifact_root() == str(home / "mlartifacts")
    with pytest.raises(ConfigError, match="inside Ray's scratch copy.*_ray_pkg_0123abcd"):
        load_config(TrainJobConfig, None, [f"output_dir={in_ray_copy / 'outputs'}"])
    assert stable_path("s3://bucket/runs") == "s3://bucket/runs"


def test_relative_sqlite_store_and_its_artifacts(in_ray_copy, tmp_path, monkeypatch):
    from runtime.tracking_store import artifact_root, tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///stores/m.db")  # relative to the cwd: the scratch copy
    assert tracking_uri() == f"sqlite:///{tmp_path / 'home' / 'stores' / 'm.db'}"
    assert artifact_root() == str(tmp_path / "home" / "stores" / "mlartifacts")  # next to the store, not the cwd


def test_outside_a_ray_copy_relative_means_the_working_directory(tmp_path, monkeypatch):
    from runtime.paths import stable_path

    monkeypatch.chdir(tmp_path)
    assert stable_path("outputs") == str(tmp_path / "outputs")


def test_workers_get_the_stores_settings_but_never_the_drivers_profile_secrets_or_node_cache(monkeypatch):
    """A profile names a section of the driver's own ~/.aws files (another node fails with ProfileNotFound even with
    keys of its own), and each node keeps its copies in its own RAOE_NODE_CACHE; the settings a node needs to reach
    an S3-compatible server (endpoint, region, CA bundle, botocore 1.36's checksum switches) go with the job."""
    from runtime.local_ray import worker_env

    settings = {"AWS_ENDPOINT_URL": "https://minio.internal:9000", "AWS_REGION": "eu-west-1",
                "AWS_CA_BUNDLE": "/etc/ssl/minio.pem", "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
    withheld = {"AWS_PROFILE": "laptop", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_SESSION_TOKEN": "token",
                "RAOE_NODE_CACHE": "/home/me/.cache/raoe/node"}
    for key, value in {**settings, **withheld}.items():
        monkeypatch.setenv(key, value)
    env = worker_env()
    assert {k: env.get(k) for k in settings} == settings and not set(withheld) & set(env)


def test_the_node_cache_defaults_to_the_nodes_temporary_disk_and_warns_on_a_network_file_system(monkeypatch, capsys):
    import tempfile
    from pathlib import Path

    import storage.node_cache as node_cache

    monkeypatch.delenv("RAOE_NODE_CACHE", raising=False)
    root = node_cache.node_cache_root()
    assert root.parent == Path(tempfile.gettempdir()) and Path.home() not in root.parents
    assert node_cache.file_system_type(Path("/proc/self")) == "proc"  # read from the mount table
    monkeypatch.setattr(node_cache, "file_system_type", lambda path: "nfs4")
    monkeypatch.setenv("RAOE_NODE_CACHE", "/mnt/shared/raoe-node")
    assert node_cache.node_cache_root() == Path("/mnt/shared/raoe-node")
    assert "on a nfs4 file system" in capsys.readouterr().out


def test_a_tracking_servers_artifact_uri_is_no_folder_in_a_jobs_scratch_copy(in_ray_copy, tmp_path, monkeypatch):
    """An experiment on a tracking server keeps its artifacts at ``mlflow-artifacts:/1``; read as a relative path it
    lay inside the job's scratch copy, and every job after the first on that experiment was refused."""
    import mlflow

    from runtime.tracking_store import ensure_experiment, local_location
    from tests.conftest import mlflow_store

    assert local_location("mlflow-artifacts:/1") is None and local_location("s3://b/a") is None
    assert local_location("file:///data/mlartifacts/1") == "/data/mlartifacts/1"
    assert local_location("/data/mlartifacts/1") == "/data/mlartifacts/1"
    store = mlflow_store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    experiment = mlflow.MlflowClient(store).create_experiment("served", artifact_location="mlflow-artifacts:/1")
    assert ensure_experiment("served") == experiment
