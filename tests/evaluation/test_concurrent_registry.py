"""Two jobs registering the same model at the same moment, then two promotions at the same moment, in separate
processes against one sqlite store: distinct versions that both load, and a champion alias on a version the
promotion rules allow (the better one), nothing half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGISTER = """
import json, sys
sys.path.insert(0, {root!r})
import mlflow
from encoders.backbone import build_encoder, export_encoder
from encoders.sources import resolve_model_source
from runtime.tracking_store import ensure_experiment
from tracking.metrics import with_retries
from tracking.registry import log_and_register
experiment = ensure_experiment("concurrent")
folder = {folder!r}
suite = {{"STSBenchmark": {avg}, "avg": {avg}}}
export_encoder(build_encoder(resolve_model_source("tiny:bert")), folder, {{"suite": suite}})
with mlflow.start_run(experiment_id=experiment) as run:
    out = with_retries(lambda: log_and_register(folder, run.info.run_id, "raoe-race"), "registering", 120)
print(json.dumps({{"version": out["version"]}}))
"""
PROMOTE = """
import json, sys
sys.path.insert(0, {root!r})
from tracking.promotion import promote
from encoders.backbone import load_encoder
def suite(path):
    load_encoder(path)
    return json.loads(open(path + "/raoe_encoder.json").read())["suite"]
print(json.dumps(promote("raoe-race", {version}, suite)))
"""


def _run_all(scripts, env):
    procs = [subprocess.Popen([sys.executable, "-c", s], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for s in scripts]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_simultaneous_registrations_and_promotions(tmp_path):
    import mlflow
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "RAOE_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts"),
           "HF_HUB_OFFLINE": "1"}
    # one registration first, so the registered model exists and the race is on the versions
    first = _run_all([REGISTER.format(root=str(ROOT), folder=str(tmp_path / "m0"), avg=70.0)], env)
    racing = _run_all([REGISTER.format(root=str(ROOT), folder=str(tmp_path / f"m{i}"), avg=avg)
                       for i, avg in ((1, 71.0), (2, 72.0))], env)
    versions = sorted([first[0]["version"]] + [r["version"] for r in racing])
    assert versions == [1, 2, 3]  # distinct
    mlflow.set_tracking_uri(store)
    client = MlflowClient(store)
    for v in versions:  # every version whole and loadable
        assert mlflow.sentence_transformers.load_model(f"models:/raoe-race/{v}").encode(["a"]).shape[0] == 1
    _run_all([PROMOTE.format(root=str(ROOT), version=1)], env)  # v1 (avg 70) becomes champion
    better = {r["version"]: 71.0 if r["version"] == racing[0]["version"] else 72.0 for r in racing}
    results = _run_all([PROMOTE.format(root=str(ROOT), version=v) for v in better], env)
    champion = int(client.get_model_version_by_alias("raoe-race", "champion").version)
    # both beat v1; whichever moved the alias second compared itself with the first's result, so the champion is
    # the better of the two, whatever the order
    assert champion == max(better, key=better.get) and any(r["promote"] for r in results)
    tags = {v: client.get_model_version("raoe-race", str(v)).tags["promotion.decision"] for v in better}
    assert tags[champion] == "promoted"
