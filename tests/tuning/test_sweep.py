"""The tiny sweep end to end: every grid point trialled as a child MLflow run of the sweep, the best config
reported and registered, and a rerun of the same sweep resumed from Tune's state without rerunning trials."""

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.own_ray  # a Ray of its own, whose workers see the sweep's store

ROOT = Path(__file__).resolve().parents[2]
GRID = {"objective.rank_margin.margin": [1, 2], "objective.rank_margin.tau": [20]}


@pytest.fixture(scope="module")
def sweep_env(tmp_path_factory, dev_data_module):
    from tests.conftest import mlflow_store, own_ray

    root = tmp_path_factory.mktemp("sweep")
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS")}
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_store(root)
    os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(root / "artifacts")
    with own_ray(num_cpus=2):
        yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def dev_data_module():
    from tests.conftest import DEV_DATA

    if not DEV_DATA.exists():
        pytest.skip(f"development data not found at {DEV_DATA} (the sweep selects by STS-B dev)")
    return DEV_DATA


def _spec(root: Path):
    from jobconfig import load_config
    from tests.conftest import DEV_DATA
    from tuning.sweep import SweepSpec

    overrides = ["trainer.max_steps=2", "trainer.eval_every=2", "eval.max_pairs=60", "model.dropout=0.0",
                 f"eval.data_dir={DEV_DATA / 'senteval'}", f"output_dir={root / 'models'}"]
    return load_config(SweepSpec, ROOT / "configs" / "tiny" / "sweep.yaml", [
        f"storage_path={root / 'tune'}", "name=tiny-sweep", f"overrides={json.dumps(overrides)}",
        "max_concurrent_trials=2",  # two trials at once fit the 2 CPUs (half a CPU per worker)
        # Two grid points: both margins of the shipped 2x2 grid at one tau, one wave of trials (a trial is ~20 s of
        # start-up) that still ranks, breaks ties, plots and registers with both keys in the grid.
        f"grid={json.dumps(GRID)}",
    ])


@pytest.fixture(scope="module")
def swept(sweep_env):
    """The sweep of _spec, once for the module. About 80 s here: a Ray of its own, and two trials at once, each a Ray
    Train run whose workers start and import the encoder stack (~20 s of start-up a trial)."""
    from tuning.sweep import run_sweep

    return run_sweep(_spec(sweep_env))


def _children(parent_run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("raoe-tiny-sweeps")
    return client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def test_every_grid_point_is_a_child_run_and_the_best_is_registered(swept):
    grid = {(r["objective.rank_margin.margin"], r["objective.rank_margin.tau"]) for r in swept["trials"]}
    assert grid == {(1, 20), (2, 20)}
    assert all(r["error"] is None and r["steps"] == 2 for r in swept["trials"])
    children = _children(swept["parent_run_id"])
    assert sorted(c.info.run_id for c in children) == sorted(r["run_id"] for r in swept["trials"])
    top = max(r["best_stsb_dev_spearman"] for r in swept["trials"])
    assert swept["best_metric"] == top
    keys = ("objective.rank_margin.margin", "objective.rank_margin.tau")
    tied = [{k: r[k] for k in keys} for r in swept["trials"] if r["best_stsb_dev_spearman"] == top]
    assert swept["best_config"] == min(tied, key=lambda c: (c[keys[0]], c[keys[1]]))  # ties: the earliest grid point
    assert swept["registered_model"] == "raoe-s1" and swept["version"] >= 1
    assert Path(swept["heatmap"]).exists()


def test_rerunning_the_sweep_resumes_without_rerunning_trials(swept, sweep_env):
    from tuning.sweep import run_sweep

    again = run_sweep(_spec(sweep_env))
    assert again["resumed"] and again["parent_run_id"] == swept["parent_run_id"]
    assert len(_children(swept["parent_run_id"])) == 2  # no new trial runs
    assert again["best_config"] == swept["best_config"]


def test_a_sweep_refuses_a_retrieval_dev_task_by_name(tmp_path):
    """Trials are ranked by STS-B dev; a base config selecting on eval.dev_retrieval is refused before Ray starts, and
    so is one training in the trial's own process."""
    from jobconfig import load_config
    from tuning.sweep import SweepSpec, validate_spec

    spec = load_config(SweepSpec, ROOT / "configs" / "tiny" / "sweep.yaml", [
        f"overrides={json.dumps(['eval.dev_retrieval=outputs/beir/stsb-dev'])}"])
    with pytest.raises(ValueError, match="eval.dev_retrieval: a sweep ranks its trials by STS-B dev"):
        validate_spec(spec, "s", str(tmp_path))
    in_process = load_config(SweepSpec, ROOT / "configs" / "tiny" / "sweep.yaml", [
        f"overrides={json.dumps(['trainer.num_workers=0'])}"])  # a trial in its own process cannot report to Tune
    with pytest.raises(ValueError, match="trainer.num_workers=0 .* cannot report to Ray Tune"):
        validate_spec(in_process, "s", str(tmp_path))
