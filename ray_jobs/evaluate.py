"""Score a sentence-embedding model on the STS tasks (SentEval "all" setting) with Ray Data encoding.

  python ray_jobs/evaluate.py --config configs/evaluate/sts.yaml --set model.source=PATH --set eval.data_dir=DIR
  model.source: a path, pypi:<package>, an HF id, or an MLflow model URI (models:/raoe-s1/2, models:/raoe-s1@champion)
"""

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import EvalConfig, Section, TrackingConfig
from runtime.result import run_job


class EvaluateModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="model path, pypi:<package>, HF id or MLflow model URI")


class EvaluateJobConfig(Section):
    model: EvaluateModel = Field(default_factory=EvaluateModel)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-eval"))
    output_dir: str = Field("outputs/eval", description="where the STS-B scatter plot goes")
    actors: int = Field(1, ge=1, description="encoder actors in the Ray Data pool")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs each encoder actor reserves")


def _model_run(source: str) -> str | None:
    """The MLflow run that produced a registered model, so its scores land next to its training metrics."""
    from mlflow import MlflowClient

    from tracking.registry import resolve_alias

    uri = resolve_alias(source)
    if uri.startswith("models:/"):
        name, version = uri.removeprefix("models:/").split("/", 1)
        return MlflowClient().get_model_version(name, version).run_id
    if uri.startswith("runs:/"):
        return uri.removeprefix("runs:/").split("/", 1)[0]
    return None


def main(cfg: EvaluateJobConfig) -> dict:
    import re
    from pathlib import Path

    import mlflow

    from evaluation.encode import score_with_ray
    from evaluation.sts import plot_cosine_vs_gold
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment, tracking_uri
    from tracking.registry import is_model_uri, resolve_model

    experiment_id = ensure_experiment(cfg.tracking.experiment)
    model_path = resolve_model(cfg.model.source)
    predictions: dict = {}
    with ray_session():
        metrics = score_with_ray(model_path, cfg.eval, actors=cfg.actors, cpus_per_actor=cfg.cpus_per_actor,
                                 predictions=predictions)
    print(f"{'task':<18}Spearman x100")
    for task, value in metrics.items():
        print(f"{task:<18}{'absent' if value is None else f'{value:.2f}'}")
    plot = None
    if "STSBenchmark" in predictions:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.model.source).strip("_")
        plot = plot_cosine_vs_gold(*predictions["STSBenchmark"], Path(cfg.output_dir) / f"{safe}-stsb.png",
                                   f"STS-B {cfg.eval.stsb_split}")
    run_id = _model_run(cfg.model.source) if is_model_uri(cfg.model.source) else None
    prefix = f"sts_{cfg.eval.stsb_split}"
    with mlflow.start_run(run_id=run_id, experiment_id=None if run_id else experiment_id,
                          run_name=None if run_id else cfg.tracking.run_name) as run:
        if run_id is None:
            mlflow.log_params({"model.source": cfg.model.source, "eval.data_dir": cfg.eval.data_dir,
                               "eval.max_pairs": cfg.eval.max_pairs, "eval.stsb_split": cfg.eval.stsb_split})
        mlflow.log_metrics({f"{prefix}/{k}": v for k, v in metrics.items() if v is not None})
        mlflow.log_dict(metrics, f"evaluation/{prefix}.json")
        if plot:
            mlflow.log_artifact(str(plot), "evaluation")
    return {"model": cfg.model.source, "model_path": model_path, "metrics": metrics,
            "absent": [k for k, v in metrics.items() if v is None], "run_id": run.info.run_id,
            "logged_on_model_run": run_id is not None, "plot": str(plot) if plot else None,
            "tracking_uri": tracking_uri()}


if __name__ == "__main__":
    config = parse_job_args(EvaluateJobConfig, __doc__)
    run_job(lambda: main(config), "evaluate")
