"""Grid sweeps over any training-config keys with Ray Tune: each trial runs the training job's Ray Train loop
(Train inside Tune, Ray 2.60's way: the trial function builds Ray Train's trainer and reports through
TuneReportCallback), as a child MLflow run of the sweep's parent run; the best trial by dev Spearman is
registered. A sweep whose driver died resumes with Tuner.restore without rerunning finished trials."""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from jobconfig import load_config
from jobconfig.schema import (
    RELATIVE,
    OutputPath,
    PosttrainJobConfig,
    RelationalJobConfig,
    Section,
    SharedFilesystem,
    Stage2JobConfig,
    TrackingConfig,
    TrainJobConfig,
    UnsupervisedJobConfig,
)
from runtime.local_ray import ray_session
from runtime.result import error_message
from runtime.tracking_store import artifact_root, ensure_experiment, tracking_uri
from tracking.model_registry import REGISTERED, log_and_register, run_for_name
from training.run import plot_dev_line, run_training

METRIC = "best_stsb_dev_spearman"


class SweepSpec(Section):
    job: Literal["stage1", "stage2", "unsupervised", "posttrain", "relational"] = Field(
        "stage1", description="which training job each trial runs")
    base_config: str = Field(..., description="the training config every trial starts from")
    overrides: list[str] = Field(default_factory=list, description="key=value applied to every trial")
    grid: dict[str, list[Any]] = Field(..., description="dotted config key -> values; the sweep is their product")
    max_concurrent_trials: int = Field(1, ge=1, description="trials running at once")
    cpus_per_trial: float = Field(0.1, gt=0, description="CPUs of each trial's driver (its workers take their own)")
    gpus_per_trial: float = Field(0.0, ge=0, description="GPUs of each trial's driver (0: the workers hold the GPUs)")
    asha: bool = Field(False, description="stop weak trials early (ASHA on dev Spearman per evaluation)")
    asha_grace_period: int = Field(2, ge=1, description="evaluations before ASHA may stop a trial")
    storage_path: OutputPath = Field("raoe_runs", validate_default=True, description="Tune results and trial "
                                     "checkpoints (local path, s3://, gs://); " + RELATIVE)
    name: str | None = Field(None, description="sweep name; rerunning a name resumes it (default: from the spec file)")
    register_best: bool = Field(True, description="register the best trial's model (raoe-s1 / -s2 / -unsup / -lists / "
                                "-rse by job)")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-sweeps"))
    shared_filesystem: SharedFilesystem = False  # and so for every trial

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not grid or any(not values for values in grid.values()):
            raise ValueError("grid needs at least one key, each with at least one value")
        return grid


def job_model(job: str):
    return {"stage1": TrainJobConfig, "stage2": Stage2JobConfig, "unsupervised": UnsupervisedJobConfig,
            "posttrain": PosttrainJobConfig, "relational": RelationalJobConfig}[job]


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict[str, Any]) -> str:
    """A short, stable name for a grid point (it names the trial's training run, so a rerun trial resumes it)."""
    text = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def trial_config(spec: SweepSpec, point: dict[str, Any], sweep_name: str, storage: str):
    """The validated training config of one grid point (raises ConfigError naming a bad key or value)."""
    overrides = [*spec.overrides, *(f"{k}={json.dumps(v)}" for k, v in point.items()),
                 f"tracking.experiment={spec.tracking.experiment}", f"tracking.run_name={sweep_name}-{point_name(point)}",
                 f"trainer.storage_path={storage}/{sweep_name}-trials", f"shared_filesystem={spec.shared_filesystem}"]
    return load_config(job_model(spec.job), spec.base_config, overrides)


def validate_spec(spec: SweepSpec, sweep_name: str, storage: str) -> list[dict[str, Any]]:
    """Every grid point validated before any trial starts."""
    points = grid_points(spec.grid)
    for point in points:
        cfg = trial_config(spec, point, sweep_name, storage)
        if cfg.trainer.in_process:
            raise ValueError("trainer.num_workers=0 trains in the job's process, which cannot report to Ray Tune: "
                             "a sweep's trials train on Ray Train workers (trainer.num_workers >= 1)")
        if getattr(cfg.eval, "dev_retrieval", None) is not None:
            raise ValueError("eval.dev_retrieval: a sweep ranks its trials by STS-B dev Spearman; selecting "
                             "trials on a retrieval dev task is not supported yet (set it in a single job)")
    return points


def run_trial(config: dict[str, Any]) -> None:
    """One Tune trial: the training job's driver with this point's config, reporting to Tune."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    if Path(config["cwd"]).is_dir():  # Tune runs trials in their own folder; config paths are the driver's
        os.chdir(config["cwd"])
    # The driver's MLflow store, explicitly: a Ray that was already running carries an older environment.
    os.environ.update(config.get("tracking_env", {}))
    spec = SweepSpec(**config["spec"])
    cfg = trial_config(spec, config["point"], config["sweep_name"], config["storage"])
    result = run_training(cfg, register=False, parent_run_id=config["parent_run_id"], callbacks=[TuneReportCallback()])
    best = result["metrics"].get(METRIC)
    ray.tune.report({METRIC: best if best is not None else float("nan"), "steps": result["metrics"]["steps"],
                     "train_loss": result["metrics"]["train_loss"], "model_path": result["model_path"],
                     "run_id": result["run_id"], "done": True})


def _tracking_env() -> dict[str, str]:
    return {"MLFLOW_TRACKING_URI": tracking_uri(), "RAOE_MLFLOW_ARTIFACTS": str(artifact_root())}


def sweep_table(results, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trial: its grid values, best dev Spearman, steps, MLflow run, and its error (the root cause)."""
    rows = []
    for r in results:
        if r.config is None:
            continue
        last = r.metrics or {}
        rows.append({**r.config["point"], METRIC: last.get(METRIC), "steps": last.get("steps"),
                     "train_loss": last.get("train_loss"), "run_id": last.get("run_id"),
                     "model_path": last.get("model_path"), "error": error_message(r.error) if r.error else None})
    return rows


def plot_heatmap(rows: list[dict[str, Any]], keys: list[str], path: Path) -> Path | None:
    """Dev Spearman over the first two grid axes (averaged over any further axes); a line over a one-axis grid."""
    if not keys or not rows:
        return None
    if len(keys) == 1:
        points = sorted((r[keys[0]], r[METRIC]) for r in rows if r[METRIC] is not None)
        return plot_dev_line([(str(x), y) for x, y in points], keys[0], path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    xs = sorted({r[keys[0]] for r in rows})
    ys = sorted({r[keys[1]] for r in rows})
    grid = np.full((len(ys), len(xs)), np.nan)
    for i, y in enumerate(ys):
        for j, x in enumerate(xs):
            vals = [r[METRIC] for r in rows if r[keys[0]] == x and r[keys[1]] == y and r[METRIC] is not None]
            if vals:
                grid[i, j] = float(np.mean(vals))
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 0.9 * len(ys) + 2))
    im = ax.imshow(grid, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel(keys[0])
    ax.set_ylabel(keys[1])
    for i in range(len(ys)):
        for j in range(len(xs)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=9)
    fig.colorbar(im, ax=ax, label="STS-B dev Spearman x100")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_sweep(spec: SweepSpec, spec_path: str | None = None) -> dict[str, Any]:
    import mlflow
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler

    sweep_name = spec.name or (Path(spec_path).stem if spec_path else "sweep")
    storage = spec.storage_path if "://" in spec.storage_path else str(Path(spec.storage_path).resolve())
    points = validate_spec(spec, sweep_name, storage)  # bad keys fail here, before Ray
    experiment_id = ensure_experiment(spec.tracking.experiment)  # in the driver: trials would race on sqlite
    parent_run_id, resumed = run_for_name(experiment_id, sweep_name, {"raoe.sweep": "parent"})
    mlflow.set_tracking_uri(tracking_uri())
    trainable = ray.tune.with_resources(run_trial, {"CPU": spec.cpus_per_trial, "GPU": spec.gpus_per_trial})
    experiment_path = f"{storage}/{sweep_name}"
    with mlflow.start_run(run_id=parent_run_id):
        if not resumed:
            mlflow.log_params({"job": spec.job, "base_config": spec.base_config, "grid": json.dumps(spec.grid)[:500],
                               "trials": len(points)})
        with ray_session(outputs={"storage_path": storage}, shared_filesystem=spec.shared_filesystem):
            if ray.tune.Tuner.can_restore(experiment_path):
                print(f"[raoe] resuming sweep {sweep_name!r} from {experiment_path}", flush=True)
                tuner = ray.tune.Tuner.restore(experiment_path, trainable=trainable, resume_errored=True)
            else:
                scheduler = ASHAScheduler(grace_period=spec.asha_grace_period) if spec.asha else None
                tuner = ray.tune.Tuner(
                    trainable,
                    param_space={"point": ray.tune.grid_search(points), "spec": spec.model_dump(),
                                 "sweep_name": sweep_name, "storage": storage, "parent_run_id": parent_run_id,
                                 "cwd": os.getcwd(), "tracking_env": _tracking_env()},
                    tune_config=ray.tune.TuneConfig(metric=METRIC, mode="max", scheduler=scheduler,
                                                    max_concurrent_trials=spec.max_concurrent_trials),
                    run_config=ray.tune.RunConfig(name=sweep_name, storage_path=storage),
                )
            print(f"[raoe] sweep {sweep_name!r}: {len(points)} trial(s) over {list(spec.grid)}", flush=True)
            results = tuner.fit()
        rows = sweep_table(results, points)
        scored = [r for r in rows if r[METRIC] is not None and r[METRIC] == r[METRIC]]
        # Ties (tiny runs often tie) go to the earliest grid point, so a resumed sweep names the same best.
        order = {json.dumps({k: p[k] for k in spec.grid}, sort_keys=True): i for i, p in enumerate(points)}
        best = max(scored, key=lambda r: (r[METRIC], -order.get(json.dumps({k: r[k] for k in spec.grid},
                                                                          sort_keys=True), 0))) if scored else None
        out = Path(storage if "://" not in storage else ".") / f"{sweep_name}-summary"
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep_table.json").write_text(json.dumps(rows, indent=2, default=str))
        mlflow.log_dict({"trials": rows}, "sweep_table.json")
        heatmap = plot_heatmap(rows, list(spec.grid), out / "dev_spearman_heatmap.png")
        if heatmap:
            mlflow.log_artifact(str(heatmap))
        registry = {"model_uri": None, "registered_model": None, "version": None}
        if best:
            mlflow.log_metric(METRIC, best[METRIC])
            if spec.register_best:
                tags = {"raoe.stage": spec.job, "sweep": sweep_name, METRIC: best[METRIC],
                        "best_config": json.dumps({k: best[k] for k in spec.grid})}
                registry = log_and_register(best["model_path"], best["run_id"], REGISTERED[spec.job], tags)
    return {
        "sweep": sweep_name, "trials": rows, "best_config": {k: best[k] for k in spec.grid} if best else None,
        "best_metric": best[METRIC] if best else None, "metric": METRIC, "experiment": spec.tracking.experiment,
        "parent_run_id": parent_run_id, "resumed": resumed, "experiment_path": experiment_path,
        "heatmap": str(heatmap) if heatmap else None, **registry,
    }
