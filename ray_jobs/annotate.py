"""Score every NLI pair with each teacher (cosine of the two sentence embeddings) and write the enhanced NLI
set: text1, text2, label, similarity S = mean over teachers (RAOE Appendix A), plus s_<teacher> columns.

  python ray_jobs/annotate.py --config configs/annotate/snli-dev-test.yaml [--set key=value ...]

Query groups (data.format groups_jsonl / groups_parquet) get teacher scores for distillation instead: each (query,
positive) and (query, negative) pair scored by every teacher (a bi-encoder's cosine, or a reranker's prediction with
teachers[].kind cross_encoder), the mean written as the group's positive_scores and negative_scores.

  python ray_jobs/annotate.py --config configs/annotate/groups-mpnet.yaml
"""

from typing import Literal

from pydantic import Field, field_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from data_pipelines.teachers import TeacherConfig
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, DataConfig, OutputPath, Section, SharedFilesystem, TrackingConfig
from runtime.result import run_job
from storage.paths import join, remove_tree, staged_folder, storage_path


class AnnotateInput(DataConfig):
    splits: list[str] = Field(default_factory=list, description="SentEval NLI splits to read (e.g. [dev, test])")


class AnnotateJobConfig(Section):
    data: AnnotateInput = Field(default_factory=AnnotateInput)
    teachers: list[TeacherConfig] = Field(default_factory=list, description="teacher models (name, source, kind, ...)")
    output_dir: OutputPath = Field("outputs/annotated", validate_default=True,
                                   description="where the scored set and its plot go; " + RELATIVE)
    output_format: str = Field("parquet", pattern="^(parquet|jsonl)$", description="parquet or jsonl")
    batch_rows: int = Field(256, ge=1, description="pairs per map_batches call")
    teacher_pools: Literal["shared", "separate"] = Field(
        "shared", description="shared: every actor holds all teachers, which take turns on each batch (no two "
        "teachers compete for the same cores); separate: one actor pool per teacher, each with its own resources")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-annotate"))
    shared_filesystem: SharedFilesystem = False

    @field_validator("teachers")
    @classmethod
    def _some_teachers(cls, teachers):
        if not teachers:
            raise ValueError("at least one teacher is needed")
        names = [t.name for t in teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        return teachers


def main(cfg: AnnotateJobConfig) -> dict:
    import json
    import time

    import mlflow

    from data_pipelines.annotate import merge_counts, plot_distribution, score_counts, summarise
    from data_pipelines.readers import load_corpus
    from data_pipelines.teachers import add_teacher_scores
    from encoders.devices import gpus_wanted_here
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment

    if not cfg.data.train:
        raise ValueError("data.train must name the NLI pairs or query groups to annotate")
    out = cfg.output_dir  # a local folder (made absolute by the config) or an object-store URI
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    if cfg.data.groups:
        return annotate_groups(cfg, experiment_id)
    started = time.time()
    gpus_wanted_here({f"teachers[{i}].gpus_per_actor": t.gpus_per_actor for i, t in enumerate(cfg.teachers)})
    with ray_session(outputs={"output_dir": cfg.output_dir}, inputs={"data.train": cfg.data.train},
                     shared_filesystem=cfg.shared_filesystem):
        datasets, reports = [], []
        for split in cfg.data.splits or [cfg.data.split]:
            ds, report = load_corpus(
                "pairs", cfg.data.train, fmt=cfg.data.format, split=split, max_rows=cfg.data.max_rows,
                shuffle_seed=cfg.data.shuffle_seed,
                on_bad_record=cfg.data.on_bad_record, quarantine_path=join(out, f"quarantine-{split or 'all'}.jsonl"),
            )
            datasets.append(ds)
            reports.append(report)
        ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
        print(f"scoring {sum(r.rows_written for r in reports)} pairs with {len(cfg.teachers)} teacher(s) ...", flush=True)
        scored = add_teacher_scores(ds, cfg.teachers, cfg.batch_rows, cfg.teacher_pools).materialize()
        remove_tree(storage_path(join(out, "data")))  # written by the tasks holding the rows, on any node
        if cfg.output_format == "parquet":
            scored.write_parquet(join(out, "data"))
        else:
            scored.write_json(join(out, "data"))
        names = [t.name for t in cfg.teachers]
        # Statistics from counts each block adds up (batches stream through the driver, none is kept)
        counts_by_block = scored.select_columns(["label", "similarity", *[f"s_{n}" for n in names]]).map_batches(
            lambda frame: {"counts": [json.dumps(score_counts(frame, names))]}, batch_format="pandas",
            batch_size=None, num_cpus=0.1)
        score_totals = merge_counts(json.loads(row["counts"]) for row in counts_by_block.iter_rows())
    seconds = time.time() - started
    stats = summarise(score_totals, names)
    scored_pairs = stats["S"]["count"]
    counts = {k: sum(getattr(r, k) for r in reports) for k in ("rows_in", "rows_written", "rows_quarantined",
                                                                 "rows_without_gold")}
    quarantine = [r.quarantine_path for r in reports if r.quarantine_path]
    with staged_folder(out) as staged:  # the plot is drawn on local disk, kept beside the data and logged from there
        plot = plot_distribution(score_totals, staged.local / "s_distribution.png")
        staged.publish()
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, "teachers": ",".join(t.source for t in cfg.teachers)})
            mlflow.log_metrics({**{k: float(v) for k, v in counts.items()},
                                "pairs_per_second": scored_pairs / seconds})
            mlflow.log_dict(stats, "s_statistics.json")
            mlflow.log_artifact(str(plot))
    return {
        "output_path": join(out, "data"), "output_format": cfg.output_format, **counts,
        "quarantine_path": quarantine[0] if len(quarantine) == 1 else (quarantine or None),
        "pairs_per_second": scored_pairs / seconds, "seconds": seconds, "statistics": stats, "plot": staged.final(plot),
        "run_id": run.info.run_id,
    }


def annotate_groups(cfg: AnnotateJobConfig, experiment_id: str) -> dict:
    """Query groups with the teachers' mean score of every (query, positive) and (query, negative) pair, written as
    positive_scores / negative_scores for distillation (objectives distill_kl, margin_mse)."""
    import time

    import mlflow

    from data_pipelines.annotate import group_score_summary, plot_group_scores
    from data_pipelines.readers import load_corpus
    from data_pipelines.teachers import add_group_scores
    from encoders.devices import gpus_wanted_here
    from runtime.local_ray import ray_session

    out, started = cfg.output_dir, time.time()
    gpus_wanted_here({f"teachers[{i}].gpus_per_actor": t.gpus_per_actor for i, t in enumerate(cfg.teachers)})
    with ray_session(outputs={"output_dir": out}, inputs={"data.train": cfg.data.train},
                     shared_filesystem=cfg.shared_filesystem):
        ds, report = load_corpus("groups", cfg.data.train, fmt=cfg.data.format, split=cfg.data.split,
                                 max_rows=cfg.data.max_rows, shuffle_seed=cfg.data.shuffle_seed,
                                 on_bad_record=cfg.data.on_bad_record, quarantine_path=join(out, "quarantine.jsonl"))
        print(f"scoring {report.rows_written} query groups with {len(cfg.teachers)} teacher(s) ...", flush=True)
        scored = add_group_scores(ds, cfg.teachers, cfg.batch_rows).materialize()
        remove_tree(storage_path(join(out, "data")))  # written by the tasks holding the rows, on any node
        (scored.write_parquet if cfg.output_format == "parquet" else scored.write_json)(join(out, "data"))
        summary = group_score_summary(scored)
    seconds = time.time() - started
    with staged_folder(out) as staged:
        plot = plot_group_scores(summary, staged.local / "group_scores.png",
                                 " + ".join(t.name for t in cfg.teachers))
        staged.publish()
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, "teachers": ",".join(t.source for t in cfg.teachers)})
            mlflow.log_metrics({"groups": summary["groups"], "pairs": summary["pairs"],
                                "pairs_per_second": summary["pairs"] / seconds})
            mlflow.log_dict(summary, "group_scores.json")
            mlflow.log_artifact(str(plot))
    return {"output_path": join(out, "data"), "output_format": cfg.output_format, "rows_in": report.rows_in,
            "rows_written": report.rows_written, "rows_quarantined": report.rows_quarantined,
            "quarantine_path": report.quarantine_path, "pairs_per_second": summary["pairs"] / seconds,
            "seconds": seconds, "statistics": {k: v for k, v in summary.items() if k != "histogram"},
            "plot": staged.final(plot), "run_id": run.info.run_id}


if __name__ == "__main__":
    config = parse_job_args(AnnotateJobConfig, __doc__)
    run_job(lambda: main(config), "annotate")
