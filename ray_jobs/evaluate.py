"""Score a sentence-embedding model on the STS tasks (SentEval "all" setting) with Ray Data encoding.

  python ray_jobs/evaluate.py --config configs/evaluate/sts.yaml --set model.source=PATH --set eval.data_dir=DIR
"""

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import EvalConfig, Section, TrackingConfig
from runtime.result import run_job


class EvaluateModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="model path, pypi:<package>, tiny:bert or HF id")


class EvaluateJobConfig(Section):
    model: EvaluateModel = Field(default_factory=EvaluateModel)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-eval"))
    actors: int = Field(1, ge=1, description="encoder actors in the Ray Data pool")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs each encoder actor reserves")


def main(cfg: EvaluateJobConfig) -> dict:
    import mlflow

    from encoders.sources import resolve_model_source
    from evaluation.encode import ray_encode
    from evaluation.sts import evaluate_sts
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment, tracking_uri

    model_path = resolve_model_source(cfg.model.source)
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    with ray_session():
        def encode(sentences):
            print(f"encoding {len(sentences)} sentences with {cfg.actors} actor(s) ...", flush=True)
            return ray_encode(model_path, sentences, batch_size=cfg.eval.batch_size, actors=cfg.actors,
                              cpus_per_actor=cfg.cpus_per_actor)

        metrics = evaluate_sts(encode, cfg.eval.data_dir, cfg.eval.tasks, max_pairs=cfg.eval.max_pairs,
                               stsb_split=cfg.eval.stsb_split)
    print(f"{'task':<18}Spearman x100")
    for task, value in metrics.items():
        print(f"{task:<18}{'absent' if value is None else f'{value:.2f}'}")
    with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
        mlflow.log_params({"model.source": cfg.model.source, "eval.data_dir": cfg.eval.data_dir,
                           "eval.max_pairs": cfg.eval.max_pairs, "eval.stsb_split": cfg.eval.stsb_split})
        mlflow.log_metrics({f"sts/{k}": v for k, v in metrics.items() if v is not None})
        mlflow.log_dict(metrics, "sts_results.json")
    return {"model": cfg.model.source, "model_path": model_path, "metrics": metrics,
            "absent": [k for k, v in metrics.items() if v is None], "run_id": run.info.run_id,
            "tracking_uri": tracking_uri()}


if __name__ == "__main__":
    config = parse_job_args(EvaluateJobConfig, __doc__)
    run_job(lambda: main(config), "evaluate")
