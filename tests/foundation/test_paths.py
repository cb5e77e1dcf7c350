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
