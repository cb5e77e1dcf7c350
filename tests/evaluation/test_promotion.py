"""Promotion rules (pure) and the registry moves they cause (a private MLflow store, real registered models)."""

import json
import os

import pytest

from tracking.promotion import decide

CHAMP = {"STS12": 70.0, "STSBenchmark": 80.0, "avg": 75.0}


@pytest.mark.parametrize(
    "candidate, margin, promoted, reason",
    [
        ({"STS12": 72.0, "STSBenchmark": 80.5, "avg": 76.25}, 0.5, True, "margin"),  # better
        ({"STS12": 69.0, "STSBenchmark": 79.8, "avg": 74.4}, 0.0, False, "below the margin"),  # worse
        ({"STS12": 70.6, "STSBenchmark": 80.0, "avg": 75.3}, 0.5, False, "below the margin"),  # within the margin
        ({"STS12": 70.0, "STSBenchmark": 80.0, "avg": 75.0}, 0.0, False, "does not improve"),  # a tie keeps the champion
        ({"STS12": 76.0, "STSBenchmark": 79.0, "avg": 77.5}, 0.0, False, "STSBenchmark drops 1.00"),  # guard
    ],
)
def test_decisions(candidate, margin, promoted, reason):
    decision = decide(candidate, CHAMP, margin=margin, guard_tasks=["STSBenchmark"], tolerance=0.5)
    assert decision.promote is promoted
    assert reason in decision.reason


def test_first_version_becomes_champion():
    assert decide({"avg": 10.0}, None).promote


@pytest.fixture
def registry(tmp_path, monkeypatch):
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))  # downloads of this store only
    import tracking.promotion

    # The settle wait guards against a promotion racing this one (tests/evaluation/test_concurrent_registry.py);
    # these promotions run one at a time, so it only waited: 2 s per promotion.
    monkeypatch.setattr(tracking.promotion, "PROMOTION_SETTLE_S", 0.0)
    import mlflow

    from runtime.tracking_store import ensure_experiment

    experiment = ensure_experiment("promotion-test")
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    return tmp_path, experiment


def _register(tmp_path, experiment, avg: float | None, name="raoe-s1") -> int:
    """A real tiny model registered under ``name``; its suite result is carried in its metadata so the test
    controls better/worse (avg None: a broken artifact that does not load)."""
    import mlflow

    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source
    from tracking.model_registry import log_and_register

    with mlflow.start_run(experiment_id=experiment) as run:
        folder = tmp_path / f"model-{avg}"
        export_encoder(build_encoder(resolve_model_source("tiny:bert")), folder,
                       {"suite": {"STSBenchmark": avg, "avg": avg}})
        registered = log_and_register(folder, run.info.run_id, name)
    if avg is None:  # storage lost the weights after registration
        from pathlib import Path
        from urllib.parse import urlparse

        model_id = registered["logged_model_uri"].removeprefix("models:/")
        location = Path(urlparse(mlflow.MlflowClient().get_logged_model(model_id).artifact_location).path)
        for weights in location.rglob("model.safetensors"):
            weights.unlink()
    return registered["version"]


def _suite(path):
    from encoders.backbone import load_encoder

    load_encoder(path)  # what the real evaluation does first: a model that does not load fails here
    return json.loads(open(f"{path}/raoe_encoder.json").read())["suite"]


def test_registry_aliases_follow_the_decisions(registry):
    from mlflow import MlflowClient

    from tracking.promotion import promote

    tmp_path, experiment = registry
    client = MlflowClient()
    champion = lambda: int(client.get_model_version_by_alias("raoe-s1", "champion").version)  # noqa: E731

    v1 = _register(tmp_path, experiment, 70.0)
    first = promote("raoe-s1", None, _suite)
    assert first["promote"] and champion() == v1

    v2 = _register(tmp_path, experiment, 69.0)  # worse: stays challenger
    worse = promote("raoe-s1", v2, _suite)
    assert not worse["promote"] and champion() == v1
    assert int(client.get_model_version_by_alias("raoe-s1", "challenger").version) == v2
    assert client.get_model_version("raoe-s1", str(v2)).tags["promotion.decision"] == "kept"

    v3 = _register(tmp_path, experiment, None)  # does not load: never promoted, champion untouched
    broken = promote("raoe-s1", v3, _suite)
    assert not broken["promote"] and "does not load" in broken["reason"] and champion() == v1

    v4 = _register(tmp_path, experiment, 72.0)  # better: becomes champion
    better = promote("raoe-s1", v4, _suite, margin=1.0)
    assert better["promote"] and better["champion_version_before"] == v1 and champion() == v4
    assert better["deltas"]["avg"] == pytest.approx(2.0)
    run_id = client.get_model_version("raoe-s1", str(v4)).run_id
    assert "promotion/v%d.json" % v4 in [f.path for f in client.list_artifacts(run_id, "promotion")]


def test_results_are_reused_on_the_same_data_and_the_first_version_is_only_probed(registry):
    from tracking.promotion import promote

    tmp_path, experiment = registry
    calls = []

    def counted(path):
        calls.append(path)
        return _suite(path)

    v1 = _register(tmp_path, experiment, 70.0, name="raoe-reuse")
    first = promote("raoe-reuse", v1, counted, eval_key="data-a")
    assert first["promote"] and calls == [] and "suite was not run" in first["reason"]  # no champion: no suite
    v2 = _register(tmp_path, experiment, 71.0, name="raoe-reuse")
    second = promote("raoe-reuse", v2, counted, eval_key="data-a")
    assert second["promote"] and sorted(second["evaluated"]) == [v1, v2] and len(calls) == 2
    v3 = _register(tmp_path, experiment, 69.0, name="raoe-reuse")
    third = promote("raoe-reuse", v3, counted, eval_key="data-a")
    assert third["reused"] == [v2] and third["evaluated"] == [v3] and len(calls) == 3  # the champion's remembered
    again = promote("raoe-reuse", v3, counted, eval_key="data-a")
    assert sorted(again["reused"]) == [v2, v3] and len(calls) == 3 and not again["promote"]
    other = promote("raoe-reuse", v3, counted, eval_key="data-b")  # other evaluation data: evaluated again
    assert sorted(other["evaluated"]) == [v2, v3] and len(calls) == 5


def test_remembered_scores_of_data_on_object_storage_are_found_from_any_working_folder(tmp_path, monkeypatch):
    """The evaluation key once resolved every data path as a local one: ``s3://bucket/eval`` became
    ``<working folder>/s3:/bucket/eval``, and a job submitted with ``--working-dir`` runs in a new scratch folder
    each time, so a score remembered for the same data was never found again."""
    from jobconfig.schema import EvalConfig
    from tracking.promotion import evaluation_key

    cfg = EvalConfig(data_dir="s3://bucket/eval")
    keys = set()
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        keys.add(evaluation_key(cfg))
    assert len(keys) == 1 and evaluation_key(EvalConfig(data_dir="s3://bucket/other")) not in keys
    monkeypatch.chdir(tmp_path / "one")  # a local path is still resolved: the same folder named two ways is one key
    assert evaluation_key(EvalConfig(data_dir="data")) == evaluation_key(EvalConfig(data_dir=str(tmp_path / "one/data")))
