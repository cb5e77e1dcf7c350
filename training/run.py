"""The driver side of a training job: validate everything, read the corpus with Ray Data, run the Ray Train
worker group, export the best checkpoint, and log and register it in MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from data_pipelines.hub import is_hub_source
from data_pipelines.readers import DataReport, corpus_files, count_where, load_corpus
from encoders.devices import gpus_wanted_here
from encoders.model_files import refuse_adapters_on_heads
from encoders.model_uris import resolve_model
from encoders.sources import cache_root
from evaluation.retrieval import read_dev_set
from evaluation.sts import stsb_dev_pairs
from jobconfig.schema import SourceConfig, TrainJobConfig, objective_params
from objectives.catalog import CATALOG, fields_read
from runtime.local_ray import ray_session, runs_local_ray, worker_env
from runtime.tracking_store import ensure_experiment, local_store, tracking_uri
from storage.node_cache import node_cache_root
from storage.paths import StagedFolder, absolute, join, staged_folder
from tracking.metrics import RunTarget, metric_name, with_retries
from tracking.model_card import model_card, write_model_card
from tracking.model_registry import REGISTERED, log_and_register, run_for_name
from training.checkpoints import MODEL_DIR, PROGRESS_FILE, refuse_other_corpus, storage_failure
from training.in_process import CheckpointKeeper, fit_in_process, refuse_the_other_mode
from training.kinds import FIELD_COLUMNS, TRAINING_KINDS, DataKind, corpus_cache_dir
from training.plan import elastic_chunk, plan_steps
from training.process_group import ProcessGroupConfig
from training.rows import CorpusBlocks, content_ordered, write_files
from training.sources import steps_per_source
from training.worker_config import RETRIEVAL_DEV_METRIC, STS_DEV_METRIC, DevSet, SourceRun, WorkerConfig
from training.worker_entry import train_on_worker

JOB_DATA = {"stage1": "pairs", "stage2": "sts", "unsupervised": "sentences", "posttrain": "lists",
            "relational": "triples"}  # each job's data


def choose_kind(cfg: TrainJobConfig) -> tuple[DataKind, set[str]]:
    """The kind of training data this job trains on, and the batch fields its objective reads (from the objectives'
    declared fields); refuses a config that cannot work before any Ray resource is taken."""
    name = JOB_DATA[cfg.stage]
    if cfg.data.format == "triplets_jsonl":
        if name != "pairs":
            raise ValueError("data.format triplets_jsonl holds (query, positive, negative) rows for a stage1 job")
        name = "mined_triplets"
    elif cfg.data.groups:
        if name != "pairs":
            raise ValueError(f"data.format {cfg.data.format} holds query groups for a stage1 job")
        name = "groups"
    elif cfg.data.triplets:
        if name != "pairs":
            raise ValueError("data.triplets builds SimCSE triplets from NLI pairs; it needs a stage1 (NLI) job")
        name = "triplets"
    if name == "sentences" and any("emb_neg" in CATALOG[n].requires for n in cfg.objective.weights):
        name = "sentences_san"  # aligned negatives only when the objective needs them: a SAN corpus trains SimCSE too
    return TRAINING_KINDS[name], check_objective_fits(cfg.objective.weights, TRAINING_KINDS[name].provides)


def check_objective_fits(weights: dict[str, float], provided: tuple[str, ...]) -> set[str]:
    """The batch fields the composite reads from data that provides ``provided``: what the workers gather, and what
    the data must really hold. A mismatch (gated_angle on STS data without labels) fails here, before Ray."""
    try:
        return fields_read(weights, provided)
    except ValueError as exc:
        raise ValueError(f"objective.weights {weights} do not fit this data: {exc}") from None


def check_batch_fits(weights: dict[str, float], global_batch: int, grad_accum: int = 1) -> None:
    """Refuse a micro-batch smaller than an objective needs: each of a step's ``grad_accum`` micro-batches (global
    batch / grad_accum rows, over every worker) is its own objective, and one RAOE pair trains to a loss and
    gradient of 0."""
    rows = global_batch // grad_accum
    short = {n: CATALOG[n].min_rows for n, w in weights.items() if float(w) != 0.0 and CATALOG[n].min_rows > rows}
    for name, needed in short.items():
        accumulated = f" / trainer.grad_accum={grad_accum} = {rows} rows a micro-batch" if grad_accum > 1 else ""
        raise ValueError(f"trainer.global_batch_size={global_batch}{accumulated} is too small for objective "
                         f"{name!r}: it compares the rows of a micro-batch and needs at least {needed}")


def without_unread_negatives(ds, needed: set[str]):
    """The rows without their hard negatives when the objective does not read them (triplets or query groups trained
    with AnglE's in-batch negatives alone): else every worker encodes and gathers them for nothing (~50% more encoder
    work)."""
    unread = [c for c in ("text_neg", "negatives") if c in ds.columns()] if "emb_neg" not in needed else []
    return ds.drop_columns(unread) if unread else ds


def default_run_name(stage: str) -> str:
    return f"{stage}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def plot_dev_curve(history: list[dict[str, Any]], metric: str, label: str, path: Path) -> Path | None:
    return plot_dev_line([(h["step"], h[metric]) for h in history if h.get(metric) is not None],
                         "optimizer step", path, ylabel=f"{label} x100")


def plot_dev_line(points: list[tuple[Any, float]], xlabel: str, path: Path,
                  ylabel: str = "STS-B dev Spearman x100") -> Path | None:
    """The dev score along one axis (a run's optimizer steps, a one-axis sweep's values); None without points."""
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(*zip(*points), marker="o")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass(frozen=True)
class Preflight:
    """What the driver settles before any Ray resource is taken: a config that cannot work fails here."""

    kind: DataKind
    needed: set[str]  # batch fields the objective reads
    params: dict[str, dict[str, Any]]  # each objective's parameters
    start_model: str
    dev: Any  # evaluation.sts.STSPairs or evaluation.retrieval.RetrievalDevSet, or None: no dev set
    dev_metric: str  # the dev score's name (training.worker_config)
    dev_label: str
    # data.sources: (the source, its kind of data, the fields its objective reads), checked like the job's own data
    sources: tuple[tuple[Any, DataKind, set[str]], ...] = ()

    @property
    def has_dev(self) -> bool:
        return self.dev is not None


def run_training(cfg: TrainJobConfig, *, register: bool = True, parent_run_id: str | None = None,
                 callbacks: list | None = None, after_step: tuple = ()) -> dict[str, Any]:
    """Train, export, log and register; returns the job's JSON-line payload. A sweep runs each trial with
    ``register=False`` (only its best trial is registered), as a child of the sweep's MLflow run, and passes
    Tune's report callback. ``after_step``: hooks every worker calls after each optimizer step (the recovery tests'
    fault injection, training.faults)."""
    import mlflow

    started = time.time()
    pre = preflight(cfg)
    run_name = cfg.tracking.run_name or default_run_name(cfg.stage)
    registered = cfg.tracking.registered_model or REGISTERED[cfg.stage]
    run_tags = {"raoe.stage": cfg.stage, **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
    run_id, resumed = run_for_name(ensure_experiment(cfg.tracking.experiment), run_name, run_tags)
    mlflow.set_tracking_uri(tracking_uri())
    with mlflow.start_run(run_id=run_id):
        if not resumed:
            resolved = cfg.model_dump()
            mlflow.log_params({k: str(v)[:500] for k, v in _flat(resolved).items()})
            mlflow.log_dict(resolved, "config.json")
        with ray_session(outputs={"output_dir": cfg.output_dir, "trainer.storage_path": cfg.trainer.storage_path,
                                  **local_store()}, inputs=_task_inputs(cfg), shared_filesystem=cfg.shared_filesystem):
            quarantine = join(_output_dir(cfg), run_name, "quarantine.jsonl")
            if pre.sources:
                corpus, report, sources = _source_data(cfg, pre, quarantine)
                extras = {}
            else:
                corpus, report, extras = _training_data(cfg, pre, quarantine)
            rows = corpus.rows
            plan = _plan(cfg, rows)
            print(f"[raoe] {cfg.stage}: {rows} {pre.kind.unit}, {plan.total_steps} steps "
                  f"({plan.steps_per_epoch} per epoch), run {run_name!r}" + (" (resumed)" if resumed else ""), flush=True)
            worker_config = _worker_config(cfg, pre, plan, corpus, extras, run_name, run_id, after_step)
            if pre.sources:
                worker_config = replace(worker_config, sources=_source_runs(cfg, pre, sources, plan))
            refuse_other_corpus(worker_config.run_folder, corpus.fingerprint, rows, cfg.data.train or cfg.stage)
            result = _fit(cfg, worker_config, run_name, callbacks)
        with staged_folder(join(_output_dir(cfg), run_name)) as out:
            best_metrics, history, curve = _export_best(result, pre, cfg, out.local)
            finished = pre.kind.finish(cfg, out.local / MODEL_DIR, extras, out.local) if pre.kind.finish else {}
            payload = _payload(cfg, pre, result, best_metrics, report, plan, run_id, run_name, resumed, out,
                               finished)
            if pre.sources:
                payload["sources"] = _source_report(worker_config.sources, cfg.trainer.seed, plan,
                                                    payload["metrics"]["steps"] or 0, cfg.tracking.retry_seconds)
            card = write_model_card(out.local / MODEL_DIR, model_card(
                cfg, {**payload, "registered_model": registered if register else None},
                _objective_description(cfg, pre), pre.kind.unit))
            out.publish()  # the model is kept before anything is logged: a tracking outage cannot lose it
            payload.update(_log_and_register(cfg, pre, payload, history, curve, card, report, plan, finished,
                                             out.local, registered if register else None))
    return {**payload, "seconds": time.time() - started}


def _objective_description(cfg: TrainJobConfig, pre: Preflight) -> dict:
    from objectives.composite import CompositeObjective  # torch: loaded by the driver once the corpus is read

    return CompositeObjective(cfg.objective.weights, pre.params).describe()


def _output_dir(cfg: TrainJobConfig) -> str:
    return absolute(cfg.output_dir)


def preflight(cfg: TrainJobConfig) -> Preflight:
    """The kind of data, the objective's fields and batch size, the start model, the corpus path and the dev set,
    all checked on the driver before any Ray resource is taken."""
    params = objective_params(cfg.objective)
    sources = tuple(_checked_source(cfg, s) for s in mixed_sources(cfg))
    if sources:  # the job's kind and fields are its first source's (for progress lines and the model card)
        kind, needed = sources[0][1], set().union(*(n for _, _, n in sources))
    else:
        kind, needed = choose_kind(cfg)
        check_batch_fits(cfg.objective.weights, cfg.trainer.global_batch_size, cfg.trainer.grad_accum)
    t = cfg.trainer
    elastic_chunk(t.global_batch_size, t.worker_range, t.grad_accum, t.chunk_size)  # divisibility rules, by key
    if t.in_process and t.use_gpu:
        _gpu_in_this_process()
    if kind.name == "lists":  # the teacher-scoring actor's GPUs, which a local Ray without them never gives
        gpus_wanted_here({"posttrain.teacher_gpus": cfg.posttrain.teacher_gpus})
    if not cfg.data.train and kind.load is None and not sources:
        raise ValueError("data.train must name the training data (a file or folder), or data.sources several")
    start_model = cfg.model.init_from or cfg.model.source
    # fails here, before any Ray resource, if it cannot be found or its head cannot train with adapters
    refuse_adapters_on_heads(resolve_model(start_model), bool(cfg.model.lora), cfg.model.quantization)
    for source_cfg, source_kind in [(source_config(cfg, s), k) for s, k, _ in sources] or [(cfg, kind)]:
        if source_kind.load is None and not is_hub_source(source_cfg.data.train):  # a missing path or a format
            corpus_files(source_cfg.data.train, source_kind.corpus, source_cfg.data.format)  # that cannot read it
    return Preflight(kind, needed, params, start_model, *_dev_set(cfg), sources=sources)


def _gpu_in_this_process() -> None:
    """trainer.num_workers=0 with trainer.use_gpu trains on a GPU of the job's own process (on a cluster, the node
    the driver runs on), never one Ray places."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("trainer.use_gpu with trainer.num_workers=0 trains on a GPU of the job's own process, and "
                         "this process sees none: set trainer.num_workers >= 1 to train on Ray's GPU workers, or "
                         "trainer.use_gpu=false")


def _task_inputs(cfg: TrainJobConfig) -> dict[str, str]:
    """The paths Ray's tasks read on any node: data.train and each data.sources[i].train (hub sources excepted)."""
    sources = getattr(cfg.data, "sources", [])
    return {"data.train": cfg.data.train,
            **{f"data.sources[{i}].train": s.train for i, s in enumerate(sources) if getattr(s, "train", None)}}


def mixed_sources(cfg: TrainJobConfig) -> list[SourceConfig]:
    """data.sources of a mixed-source job (the relational job's data.sources are relation corpora, mixed apart)."""
    return [s for s in getattr(cfg.data, "sources", []) if isinstance(s, SourceConfig)]


def source_config(cfg: TrainJobConfig, source: SourceConfig) -> TrainJobConfig:
    """The job's config reading ``source`` alone, with its objective weights."""
    objective = cfg.objective.model_copy(update={"weights": source.objective or cfg.objective.weights})
    return cfg.model_copy(update={"data": source.as_data(cfg.data), "objective": objective})


def _checked_source(cfg: TrainJobConfig, source: SourceConfig) -> tuple[SourceConfig, DataKind, set[str]]:
    """A source's kind of data and the fields its objective reads, or the error naming it."""
    if cfg.stage == "relational":
        raise ValueError("data.sources of the relational job are relation corpora (data.sources[].mapping)")
    try:
        kind, needed = choose_kind(source_config(cfg, source))
        if kind.load is not None or kind.setup_model is not None:
            raise ValueError(f"{kind.name} data cannot be one of several sources")
        check_batch_fits(source.objective or cfg.objective.weights, cfg.trainer.global_batch_size,
                         cfg.trainer.grad_accum)
    except ValueError as exc:
        raise ValueError(f"data.sources[{source.label}]: {exc}") from None
    return source, kind, needed


def _dev_set(cfg: TrainJobConfig) -> tuple[Any, str, str]:
    """(the dev set, read here once and handed to the workers; its metric; its label): eval.dev_retrieval when
    set, else STS-B dev under eval.data_dir (None when absent)."""
    task = cfg.eval.dev_retrieval
    if task is not None:
        dev = read_dev_set(task.source, task.split, task.task_name, task.max_queries,
                           ignore_identical_ids=task.ignore_identical_ids)
        print(f"[raoe] checkpoints selected by {dev.task.name} nDCG@10: {len(dev.task.query_ids)} queries, "
              f"{len(dev.corpus_ids):,} documents", flush=True)
        return dev, RETRIEVAL_DEV_METRIC, f"{dev.task.name} nDCG@10"
    pairs = stsb_dev_pairs(cfg.eval.data_dir, cfg.eval.max_pairs)
    if pairs is None:
        print(f"[raoe] no STS-B dev under eval.data_dir={cfg.eval.data_dir!r}: no dev score, keeping the latest "
              f"{cfg.trainer.keep_checkpoints} checkpoint(s) and exporting the last", flush=True)
    return pairs, STS_DEV_METRIC, "STS-B dev Spearman"


def _training_data(cfg: TrainJobConfig, pre: Preflight, quarantine: Path):
    """(the content-ordered training rows in Ray's object store, DataReport, the kind's extras for the workers)."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False  # the loop prints its own progress
    kind, extras = pre.kind, {}
    if kind.load is not None:
        ds, report, extras = kind.load(cfg, quarantine)
    else:
        ds, report = load_corpus(kind.corpus, cfg.data.train, fmt=cfg.data.format, split=cfg.data.split,
                                 max_rows=None if kind.name == "triplets" else cfg.data.max_rows,
                                 shuffle_seed=cfg.data.shuffle_seed, on_bad_record=cfg.data.on_bad_record,
                                 quarantine_path=quarantine, cache_dir=corpus_cache_dir(cfg),
                                 cache_max_gb=cfg.data.cache_max_gb)
    ds, rows = kind.prepare(ds, ds.count() if kind.load else report.rows_written, cfg, pre.start_model)
    ds = without_unread_negatives(ds, pre.needed)
    if "scores" in pre.needed:
        missing = count_where(ds, _without_similarity)
        if missing:
            raise ValueError(f"{missing} of {report.rows_written} training pairs have no similarity S; "
                             f"annotate them first (ray_jobs/annotate.py) or pick objectives without S")
    corpus = content_ordered(ds)
    if corpus.rows != rows:
        raise RuntimeError(f"ordering the corpus gave {corpus.rows} rows of {rows}")
    if cfg.data.node_local:  # named by content and columns (the fingerprint hashes values only)
        columns = hashlib.sha1(",".join(ds.columns()).encode()).hexdigest()[:8]
        corpus = write_files(corpus, join(_storage(cfg), "corpus_files", f"{corpus.fingerprint}-{columns}"))
        print(f"[raoe] data.node_local: the corpus as memory-mapped files, {corpus.files}; each node copies it "
              f"once to {node_cache_root()}", flush=True)
    return corpus, report, extras


def _plan(cfg: TrainJobConfig, rows: int, max_steps: int | None = None):
    t = cfg.trainer
    return plan_steps(rows, world=t.worker_range[1], global_batch=t.global_batch_size, grad_accum=t.grad_accum,
                      chunk_size=elastic_chunk(t.global_batch_size, t.worker_range, t.grad_accum, t.chunk_size),
                      epochs=t.epochs, max_steps=max_steps or t.max_steps, warmup_ratio=t.warmup_ratio)


def _source_data(cfg: TrainJobConfig, pre: Preflight, quarantine: str):
    """Every source's content-ordered rows; one corpus standing for them all (their rows and a fingerprint of
    every source's, which checkpoints record), their reports added up, and (source, kind, needed, corpus) each."""
    sources, reports = [], []
    for source, kind, needed in pre.sources:
        corpus, report, _ = _training_data(source_config(cfg, source), replace(pre, kind=kind, needed=needed),
                                           quarantine.replace("quarantine.jsonl", f"quarantine-{source.label}.jsonl"))
        print(f"[raoe] source {source.label}: {corpus.rows} {kind.unit} (weight {source.weight})", flush=True)
        sources.append((source, kind, needed, corpus))
        reports.append(report)
    fingerprint = hashlib.sha1("|".join(f"{s.label}:{c.fingerprint}" for s, _, _, c in sources).encode()).hexdigest()
    joined = replace(sources[0][3], rows=sum(c.rows for *_, c in sources), fingerprint=fingerprint[:16])
    return joined, DataReport.added(reports), sources


def _source_runs(cfg: TrainJobConfig, pre: Preflight, sources: list, plan) -> tuple[SourceRun, ...]:
    """What the workers need of each source: its kind, rows, plan (the run's steps over its own rows), objective,
    fields, group size and prompts."""
    runs = []
    for source, kind, needed, corpus in sources:
        try:
            own = _plan(cfg, corpus.rows, max_steps=plan.total_steps)
        except ValueError as exc:
            raise ValueError(f"data.sources[{source.label}] ({corpus.rows} rows): {exc}") from None
        runs.append(SourceRun(
            name=re.sub(r"[^A-Za-z0-9_.-]+", "_", source.label), weight=source.weight, kind=kind.name, corpus=corpus,
            plan=own, objective_weights=source.objective or cfg.objective.weights,
            fields=tuple(sorted(needed & set(FIELD_COLUMNS))),
            group_size=source_config(cfg, source).data.texts_per_group if kind.name == "groups" else 1,
            prompts=source.prompts))
    return tuple(runs)


def _source_report(sources: tuple[SourceRun, ...], seed: int, plan, steps: int,
                   retry_seconds: float) -> dict[str, dict]:
    """Per source: its rows, the steps drawn from it and the rows they trained (the JSON line; MLflow metrics
    source_steps/<name> and source_rows_trained/<name>)."""
    import mlflow

    drawn = steps_per_source([s.weight for s in sources], seed, steps)
    report = {s.name: {"kind": s.kind, "weight": s.weight, "rows": s.corpus.rows, "steps": n,
                       "rows_trained": n * plan.global_batch} for s, n in zip(sources, drawn)}
    with_retries(lambda: mlflow.log_metrics({
        **{metric_name(f"source_steps/{name}"): r["steps"] for name, r in report.items()},
        **{metric_name(f"source_rows_trained/{name}"): r["rows_trained"] for name, r in report.items()}}),
        "logging the sources' steps", retry_seconds)
    return report


def _without_similarity(table):
    """Rows whose S is missing or NaN (an all-null column has Arrow's null type)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table["similarity"]
    if pa.types.is_null(column.type):
        return pa.array([True] * len(column))
    return pc.fill_null(pc.is_nan(column.cast(pa.float64())), True)


def _run_folder_uri(cfg: TrainJobConfig, path: str) -> str:
    """Ray Train's run folder as the user names it: Ray gives a path inside its file system, without the scheme."""
    storage = _storage(cfg)
    return f"{storage.split('://')[0]}://{path.lstrip('/')}" if "://" in storage else path


def _storage(cfg: TrainJobConfig) -> str:
    return absolute(cfg.trainer.storage_path)


def _worker_config(cfg: TrainJobConfig, pre: Preflight, plan, corpus: CorpusBlocks, extras: dict, run_name: str,
                   run_id: str, after_step: tuple):
    import ray

    return WorkerConfig(
        model=cfg.model, trainer=cfg.trainer, start_model=pre.start_model,
        objective_weights=cfg.objective.weights, objective_params=pre.params, plan=plan, corpus=corpus,
        prefetch=cfg.data.prefetch if cfg.data.prefetch is not None else cfg.trainer.use_gpu,
        kind=pre.kind.name,
        fields=tuple(sorted(pre.needed & set(FIELD_COLUMNS))),
        dev=DevSet(data=ray.put(pre.dev) if pre.has_dev else None, metric=pre.dev_metric, label=pre.dev_label,
                   batch_size=cfg.eval.batch_size, relation_weights=getattr(cfg.eval, "relation_weights", None)),
        run_folder=f"{_storage(cfg).rstrip('/')}/{run_name}",  # where Ray Train puts this run's checkpoints
        tracking=RunTarget(tracking_uri(), run_id, cfg.tracking.retry_seconds),
        extras={k: v for k, v in extras.items() if k not in ("heldout", "counts")},  # driver-side only
        after_step=tuple(after_step), group_size=cfg.data.texts_per_group if pre.kind.name == "groups" else 1,
        matryoshka=cfg.objective.matryoshka.pairs() if cfg.objective.matryoshka else (),
    )


def _fit(cfg: TrainJobConfig, worker_config: WorkerConfig, run_name: str, callbacks: list | None):
    """The Ray Train worker group; a checkpoint that cannot be written ends the run with where and what to do."""
    import ray.train

    t = cfg.trainer
    score = worker_config.dev.metric if worker_config.dev.data is not None else None
    refuse_the_other_mode(worker_config.run_folder, t.in_process)
    if t.in_process:
        from training.loop import train_loop_per_worker  # torch, the encoder stack: this process trains

        if callbacks:
            raise ValueError("trainer.num_workers=0 (training in the job's process) cannot report to a Ray Tune "
                             "sweep: give its trials trainer.num_workers >= 1")
        print("[raoe] trainer.num_workers=0: training in this process (Ray Train's local mode)", flush=True)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", _worker_env()["TORCH_EXTENSIONS_DIR"])
        keeper = CheckpointKeeper(worker_config.run_folder, t.keep_checkpoints, score)
        return fit_in_process(train_loop_per_worker, worker_config, run_name, keeper, t.use_gpu)
    if t.elastic and t.max_failures == 0:
        print(f"[raoe] trainer.num_workers {list(t.num_workers)} is elastic but trainer.max_failures is 0: a lost "
              f"worker ends the run instead of going on with fewer", flush=True)
    trainer = _ray_trainer(
        # No Ray Data iterator per worker: each maps the content-ordered blocks (worker_config.corpus) and takes its
        # rows by index (training/plan.py), so the rows of a step do not depend on how Ray Data hands out blocks.
        train_on_worker, train_loop_config=worker_config,
        backend_config=ProcessGroupConfig(backend="nccl" if cfg.trainer.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=tuple(t.num_workers) if t.elastic else t.worker_range[0], use_gpu=t.use_gpu,
            resources_per_worker=None if cfg.trainer.use_gpu else {"CPU": cfg.trainer.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=_storage(cfg),
            checkpoint_config=ray.train.CheckpointConfig(  # by dev score, else the latest
                num_to_keep=cfg.trainer.keep_checkpoints,
                checkpoint_score_attribute=score,
                checkpoint_score_order="max"),
            failure_config=ray.train.FailureConfig(max_failures=cfg.trainer.max_failures),
            worker_runtime_env={"env_vars": _worker_env()}, callbacks=callbacks or None,
        ),
    )
    try:
        return trainer.fit()
    except Exception as exc:
        failure = storage_failure(exc, worker_config.run_folder)
        if failure is None:
            raise
        raise failure from exc


def _ray_trainer(train_loop_per_worker, **kwargs):
    """Ray Train's trainer on raoe's process group (training/process_group.py: neither this driver nor the
    controller imports torch to start the workers), without the helper actors a raoe run never uses. Each is a Python
    process of its own that imports Ray Train (about 2.5 s of CPU, per run, beside the workers starting): the dataset
    manager serves the Ray Datasets given to the trainer, and raoe gives none (workers map the content-ordered blocks
    themselves); on the local Ray a job starts, the placement-group cleaner (which frees the workers' resources if the
    controller dies while the cluster lives on) has nothing to outlive it, that Ray stops with the job. A cluster keeps
    the cleaner."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    unused = (DatasetsCallback, PlacementGroupCleanerCallback) if runs_local_ray() else (DatasetsCallback,)

    class LeanTrainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]

    return LeanTrainer(train_loop_per_worker, **kwargs)


def _export_best(result, pre: Preflight, cfg: TrainJobConfig, out_dir: Path):
    """The best checkpoint's model into ``out_dir``, with the config and the dev curve; (its metrics, its history,
    the curve's PNG or None without dev scores)."""
    best_checkpoint, best_metrics = _best(result, pre.dev_metric if pre.has_dev else None)
    with best_checkpoint.as_directory() as folder:
        shutil.rmtree(out_dir / MODEL_DIR, ignore_errors=True)
        shutil.copytree(Path(folder) / MODEL_DIR, out_dir / MODEL_DIR)
        history = _history(Path(folder))
    (out_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    return best_metrics, history, plot_dev_curve(history, pre.dev_metric, pre.dev_label, out_dir / "dev_curve.png")


def _payload(cfg: TrainJobConfig, pre: Preflight, result, best_metrics: dict, report, plan, run_id: str,
             run_name: str, resumed: bool, out: StagedFolder, finished: dict) -> dict[str, Any]:
    """The job's JSON-line payload (registration fills model_uri, registered_model and version); its paths are
    where the files are kept (on object storage when output_dir is a URI)."""
    final = result.metrics or {}
    best_dev = best_metrics.get(pre.dev_metric) if pre.has_dev else None
    return {
        "stage": cfg.stage, "run_id": run_id, "run_name": run_name, "resumed": resumed,
        "model_path": join(out.target, MODEL_DIR), "model_uri": None, "registered_model": None, "version": None,
        "metrics": {"train_loss": final.get("train_loss"), "grad_norm": final.get("grad_norm"),
                    "steps": final.get("step"), "best_" + pre.dev_metric: best_dev,
                    "best_step": best_metrics.get("step")},
        "start_model": pre.start_model,
        "rows_in": report.rows_in, "rows_written": report.rows_written,
        "rows_quarantined": report.rows_quarantined, "quarantine_path": report.quarantine_path,
        "corpus_cache": report.cache,  # "read" or "written" (data.cache), None when not cached (RSE's mix)
        "plan": plan.as_dict(), "strategy": cfg.trainer.strategy, "num_workers": cfg.trainer.num_workers,
        "quantization": cfg.model.quantization, "lora": cfg.model.lora.model_dump() if cfg.model.lora else None,
        "checkpoint_path": _run_folder_uri(cfg, result.path), "tracking_uri": tracking_uri(),
        "experiment": cfg.tracking.experiment,
        **{k: out.final(v) if _written_under(v, out.local) else v for k, v in finished.items()},
    }


def _written_under(value: Any, folder: Path) -> bool:
    return isinstance(value, str) and Path(value).is_relative_to(folder)


def _log_and_register(cfg: TrainJobConfig, pre: Preflight, payload: dict, history: list, curve: Path | None,
                      card: Path, report, plan, finished: dict, out_dir: Path, registered: str | None) -> dict[str, Any]:
    """The run's results in MLflow and (unless a sweep trial) the registered version from the local ``out_dir``,
    each waiting out a tracking outage for tracking.retry_seconds; returns what registration adds to the payload."""
    import mlflow

    metrics = payload["metrics"]

    def log_results() -> None:  # idempotent, so a tracking outage can be waited out (with_retries)
        mlflow.log_dict({"history": history, "plan": plan.as_dict(), "data": report.as_dict()},
                        "training_summary.json")
        if curve:
            mlflow.log_artifact(str(curve))
        _log_finished(finished)
        per_step = ("train_loss", "grad_norm")  # logged per step already: the final values get their own names
        mlflow.log_metrics({("final_" + k if k in per_step else k): float(v) for k, v in metrics.items()
                            if v is not None})
        mlflow.log_artifact(str(card), "model_card")
        mlflow.set_tag("raoe.model_card", "model_card/README.md")

    keep = f"; the trained model is safe at {payload['model_path']}"
    with_retries(log_results, "logging the results to MLflow" + keep, cfg.tracking.retry_seconds)
    if registered is None:
        return {}
    tags = {"raoe.stage": cfg.stage, "data": cfg.data.train or "", "objective": json.dumps(cfg.objective.weights),
            "start_model": pre.start_model, pre.dev_metric: metrics["best_" + pre.dev_metric]}
    return with_retries(lambda: log_and_register(out_dir / MODEL_DIR, payload["run_id"], registered, tags),
                        f"registering {registered}" + keep, cfg.tracking.retry_seconds)


def _log_finished(finished: dict[str, Any]) -> None:
    """A data kind's after-training results into the run: numbers as metrics, PNGs as artifacts."""
    import mlflow

    numbers = {k: float(v) for k, v in _flat(finished).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if numbers:
        mlflow.log_metrics({metric_name(k): v for k, v in numbers.items()})
    for value in _flat(finished).values():
        if isinstance(value, str) and value.endswith(".png") and Path(value).exists():
            mlflow.log_artifact(value)


def _best(result, dev_metric: str | None):
    """The best checkpoint by the dev score (ties: the later one), or the latest when the run has no dev set."""
    if result.best_checkpoints:
        dev = (lambda m: m.get(dev_metric, float("-inf"))) if dev_metric else (lambda m: 0.0)
        return max(result.best_checkpoints, key=lambda cm: (dev(cm[1]), cm[1].get("step", 0)))
    if result.checkpoint is None:
        raise RuntimeError(f"training reported no checkpoint: {result.error}")
    return result.checkpoint, result.metrics or {}


def _history(folder: Path) -> list[dict[str, Any]]:
    progress = folder / PROGRESS_FILE
    return json.loads(progress.read_text()).get("history", []) if progress.exists() else []


def _worker_env() -> dict[str, str]:
    env = worker_env()
    # An op DeepSpeed compiles (25-80 s here; none on raoe's own path, see strategy.without_inference_shm_op) is
    # kept in a cache every worker shares.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions")))
    # Train v2 tees every print of a worker to its logger as well as to stdout: each progress line came out twice.
    env.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    return env


