"""Two jobs registering the same model at the same moment, then promoting their versions at the same moment, in
separate processes against one sqlite store: distinct versions that all load, and the champion alias on the version the
promotion rules allow (the better one, whichever moved the alias last), nothing half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "raoe-race"


def register(folder: str, avg: float) -> int:
    """A tiny model whose suite result (``avg``) rides in its metadata, registered as a job would."""
    import mlflow

    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source
    from runtime.tracking_store import ensure_experiment
    from tracking.metrics import with_retries
    from tracking.model_registry import log_and_register

    export_encoder(build_encoder(resolve_model_source("tiny:bert")), folder,
                   {"suite": {"STSBenchmark": avg, "avg": avg}})
    with mlflow.start_run(experiment_id=ensure_experiment("concurrent")) as run:
        return with_retries(lambda: log_and_register(folder, run.info.run_id, NAME), "registering", 120)["version"]


def promote_version(version: int) -> dict:
    from encoders.backbone import load_encoder
    from tracking.promotion import promote

    def suite(path):
        load_encoder(path)
        return json.loads(open(f"{path}/raoe_encoder.json").read())["suite"]

    return promote(NAME, version, suite)


def register_then_promote(folder: str, avg: float, barrier: str, parties: int = 2) -> dict:
    """``register``, then wait until every party has registered (a file each in ``barrier``), then promote the
    version registered here: each process takes part in both races."""
    import time

    version = register(folder, avg)
    Path(barrier, f"{version}.registered").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(barrier).glob("*.registered"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other registration never finished ({barrier})")
        time.sleep(0.05)
    return {"version": version, "avg": avg, "promotion": promote_version(version)}


def _at_once(calls: list[str], env) -> list:
    """Each call (Python source using this module) in its own process, all started together."""
    head = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from tests.evaluation.test_concurrent_registry import *; "
    procs = [subprocess.Popen([sys.executable, "-c", head + f"print(json.dumps({call}))"], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for call in calls]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_simultaneous_registrations_and_promotions(tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    from tests.conftest import mlflow_store

    store = mlflow_store(tmp_path)
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "RAOE_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts"),
           "HF_HUB_OFFLINE": "1"}
    for key in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS"):
        monkeypatch.setenv(key, env[key])
    import tracking.promotion

    monkeypatch.setattr(tracking.promotion, "PROMOTION_SETTLE_S", 0.0)  # this process promotes alone; the racing
    # subprocesses import the module afresh and keep the settle wait they race with
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store)
    try:
        assert register(str(tmp_path / "m0"), 70.0) == 1  # here: the registered model exists, v1 is champion
        assert promote_version(1)["promote"]
        barrier = tmp_path / "barrier"
        barrier.mkdir()
        # two processes register at once, then (once both have) promote their versions at once
        racing = _at_once([f"register_then_promote({str(tmp_path / m)!r}, {avg}, {str(barrier)!r})"
                           for m, avg in (("m1", 71.0), ("m2", 72.0))], env)
        assert sorted(r["version"] for r in racing) == [2, 3]  # distinct versions
        for version in (1, 2, 3):  # every version whole and loadable
            model = mlflow.sentence_transformers.load_model(f"models:/{NAME}/{version}")
            assert model.encode(["a man plays music."]).shape[0] == 1
        avg = {r["version"]: r["avg"] for r in racing}
        results = [r["promotion"] for r in racing]
        client = MlflowClient(store)
        champion = int(client.get_model_version_by_alias(NAME, "champion").version)
        assert champion == max(avg, key=avg.get) and any(r["promote"] for r in results)
        assert client.get_model_version(NAME, str(champion)).tags["promotion.decision"] == "promoted"
    finally:
        mlflow.set_tracking_uri(previous)
