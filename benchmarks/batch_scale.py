"""The exact large batch: memory and time as the global batch grows, with and without cached embeddings, and the
tiled in-batch losses against the dense ones.

  python benchmarks/batch_scale.py [--batches 64 256 1024 4096] [--chunk 32] [--direct-max 1024]
                                   [--losses 4096 16384 65536] [--dense-max 16384] [--quick]

1. **Memory per worker against the global batch.** The MiniLM student (max length 48) on STS-B train pairs, the
   AnglE objective (CoSENT + in-batch negatives + angle), 2 DDP workers (gloo processes, one torch thread each), one
   warm-up step then one timed step, through the training loop's own ``Stepper``: direct (every chunk's activations
   held until one backward) and cached (``trainer.cache_embeddings``), chunks of ``--chunk`` rows. Peak RSS per
   worker during the two steps (the kernel's high-water mark, reset once the model is loaded), and the RSS then.
2. **The in-batch losses at large B.** InfoNCE + AnglE's in-batch negatives on random 384-d embeddings gathered over
   2 workers: each worker's tiled share (objectives.tiled) against the former dense form (every worker the whole
   B x B logits), forward and backward, time and the process's peak RSS (the dense form as far as memory allows).
3. **8 and 64 GPUs**, worked out from the measured bytes per logit (dense) and per anchor (tiled).

Results: ``benchmarks/results/batch_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402
from benchmarks.training_throughput import MAX_LENGTH, MODEL, load_pairs  # noqa: E402

WORKERS, DIM = 2, 384
OBJECTIVE = {"cosent": 1.0, "angle_ibn": 1.0, "angle": 1.0}


def _reset_peak() -> None:
    """Start the process's peak RSS (VmHWM) again from its current RSS (Linux), so the peak is the steps' own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _start(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORKERS), "HF_HUB_OFFLINE": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORKERS)


def train_steps(rank: int, port: int, batch: int, chunk: int, cached: bool, out) -> None:
    """One warm-up and one timed optimizer step of the student on ``batch`` STS-B pairs; reports memory and time."""
    import numpy as np
    import torch

    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source
    from jobconfig.schema import TrainerConfig
    from objectives.composite import CompositeObjective
    from training.kinds import TRAINING_KINDS, BatchContext
    from training.plan import plan_steps
    from training.rows import InMemoryRows
    from training.step import Stepper
    from training.strategy import STRATEGIES

    _start(rank, port)
    frame = load_pairs(2 * batch)
    rows = {"text1": frame["sentence1"].to_numpy(object), "text2": frame["sentence2"].to_numpy(object),
            "similarity": frame["score"].to_numpy(np.float64)}
    model = build_encoder(resolve_model_source(MODEL), pooling="mean", max_length=MAX_LENGTH).train()
    trainer = TrainerConfig(num_workers=WORKERS, global_batch_size=batch, chunk_size=chunk, cache_embeddings=cached,
                            lr=5e-5, warmup_ratio=0.0)
    plan = plan_steps(len(frame), world=WORKERS, global_batch=batch, chunk_size=chunk, max_steps=2)
    strategy = STRATEGIES["ddp"](model, trainer, plan, WORKERS)
    kind = TRAINING_KINDS["sts"]
    batches = BatchContext(module=strategy.module, model=model, device=torch.device("cpu"), length_buckets=2,
                           fields=("scores",))
    stepper = Stepper(plan, 42, kind, batches, strategy, CompositeObjective(OBJECTIVE), rank, cache_embeddings=cached)
    feed = stepper.feed(InMemoryRows(rows), prefetch=False)
    loaded = _rss_mb()
    _reset_peak()
    times, losses = [], []
    for step in range(2):
        started = time.perf_counter()
        loss, _ = stepper(feed, step)
        strategy.step()
        times.append(time.perf_counter() - started)
        losses.append(loss)
    feed.close()
    out.put({"rank": rank, "loaded_mb": loaded, "peak_mb": _peak_mb(), "step_s": times[1], "losses": losses})


def loss_step(rank: int, port: int, batch: int, form: str, out) -> None:
    """InfoNCE + AnglE in-batch negatives on ``batch`` random embeddings gathered over the workers, forward and
    backward: this worker's tiled share, or the former dense form (the whole B x B on every worker)."""
    import torch

    from objectives.composite import SPECS, EmbeddingBatch, anchor_rows
    from objectives.gather import gather_no_grad, gather_with_grad

    _start(rank, port)
    local = batch // WORKERS
    g = torch.Generator().manual_seed(rank)
    e1, e2 = (torch.randn(local, DIM, generator=g, requires_grad=True) for _ in range(2))
    labels = torch.randint(0, 3, (local,), generator=g)
    before = _rss_mb()
    _reset_peak()
    started = time.perf_counter()
    b = EmbeddingBatch(emb1=gather_with_grad(e1), emb2=gather_with_grad(e2), labels=gather_no_grad(labels))
    params = {"infonce": {"tau": 0.05}, "angle_ibn": {"tau": 20.0, "positive_threshold": 0.8}}
    rows = anchor_rows(batch, rank, WORKERS)
    if form == "tiled":
        loss = sum(SPECS[n].share(b, p, rows) for n, p in params.items())
    else:
        loss = sum(SPECS[n].compute(b, p) for n, p in params.items()) / WORKERS  # each worker the whole batch
    loss.backward()
    seconds = time.perf_counter() - started
    out.put({"rank": rank, "seconds": seconds, "peak_mb": _peak_mb(), "before_mb": before,
             "grad_norm": float(e1.grad.norm())})


def _group(target, *args) -> list[dict]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    out = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [context.Process(target=target, args=(r, port, *args, out)) for r in range(WORKERS)]
    for w in workers:
        w.start()
    results = sorted((out.get(timeout=3600) for _ in workers), key=lambda r: r["rank"])
    for w in workers:
        w.join(timeout=60)
    return results


def _mb(x: float) -> str:
    return f"{x:,.0f} MB"


def render() -> None:
    """The report again from the saved results (``--render``)."""
    import json

    from benchmarks.common import RESULTS

    saved = json.loads((RESULTS / "batch_scale.json").read_text())
    args = argparse.Namespace(chunk=saved["chunk"])
    report(args, saved["training"], saved["losses"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--losses", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dense-max", type=int, default=16384, help="largest B the dense form is run at")
    parser.add_argument("--direct-max", type=int, default=1024, help="largest global batch the direct (uncached) step "
                        "is run at: at 4,096 it would hold about 16 GB of activations per worker here")
    parser.add_argument("--quick", action="store_true", help="batches 64 256, losses 4096 8192 (minutes)")
    parser.add_argument("--render", action="store_true", help="write the report again from the saved results")
    args = parser.parse_args()
    if args.render:
        return render()
    if args.quick:
        args.batches, args.losses, args.dense_max, args.direct_max = [64, 256], [4096, 8192], 8192, 256
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    training = []
    for batch in args.batches:
        for cached in (False, True):
            if not cached and batch > args.direct_max:
                continue
            print(f"[batch_scale] student, global batch {batch}, {'cached' if cached else 'direct'}", flush=True)
            ranks = _group(train_steps, batch, args.chunk, cached)
            training.append({"batch": batch, "cached": cached, "peak_mb": max(r["peak_mb"] for r in ranks),
                             "loaded_mb": max(r["loaded_mb"] for r in ranks),
                             "step_s": max(r["step_s"] for r in ranks), "losses": ranks[0]["losses"]})
            print(f"[batch_scale]   peak {training[-1]['peak_mb']:.0f} MB, step {training[-1]['step_s']:.2f} s, "
                  f"losses {training[-1]['losses']}", flush=True)
    losses = []
    for batch in args.losses:
        for form in ("dense", "tiled"):
            if form == "dense" and batch > args.dense_max:
                continue
            print(f"[batch_scale] InfoNCE + AnglE in-batch, B = {batch}, {form}", flush=True)
            ranks = _group(loss_step, batch, form)
            losses.append({"batch": batch, "form": form, "seconds": max(r["seconds"] for r in ranks),
                           "peak_mb": max(r["peak_mb"] for r in ranks), "before_mb": max(r["before_mb"] for r in ranks),
                           "grad_norm": ranks[0]["grad_norm"]})
            print(f"[batch_scale]   {losses[-1]['seconds']:.1f} s, peak {losses[-1]['peak_mb']:.0f} MB", flush=True)
    report(args, training, losses)


def _projection(losses: list[dict]) -> list[dict]:
    """Per-GPU memory of the in-batch losses at 512 rows per GPU on 8 and 64 GPUs: the dense form's bytes per logit
    and the tiled form's bytes per gathered row, from the largest measured runs of each."""
    dense = max((x for x in losses if x["form"] == "dense"), key=lambda x: x["batch"], default=None)
    tiled = max((x for x in losses if x["form"] == "tiled"), key=lambda x: x["batch"], default=None)
    if dense is None or tiled is None:
        return []
    per_logit = (dense["peak_mb"] - dense["before_mb"]) / dense["batch"] ** 2
    per_row = (tiled["peak_mb"] - tiled["before_mb"]) / tiled["batch"]
    out = []
    for gpus in (8, 64):
        batch = 512 * gpus
        out.append({"gpus": gpus, "batch": batch, "dense_mb": per_logit * batch**2, "tiled_mb": per_row * batch})
    return out


def report(args, training: list[dict], losses: list[dict]) -> None:
    lines = ["# The exact large batch: cached embeddings and tiled in-batch losses", "",
             f"`python benchmarks/batch_scale.py` on {machine()['cpus']} CPUs, {WORKERS} gloo workers, 1 torch thread "
             f"each. Student `{MODEL}` (max length {MAX_LENGTH}), STS-B train pairs, AnglE objective "
             f"(CoSENT + in-batch negatives + angle), chunks of {args.chunk}.", "",
             "## Memory per worker against the global batch", "",
             "| global batch | mode | peak RSS per worker | model loaded | timed step | step-1 loss |",
             "|---|---|---|---|---|---|"]
    for t in training:
        lines.append(f"| {t['batch']:,} | {'cached' if t['cached'] else 'direct'} | {_mb(t['peak_mb'])} | "
                     f"{_mb(t['loaded_mb'])} | {t['step_s']:.2f} s | {t['losses'][0]:.6f} |")
    by = {(t["batch"], t["cached"]): t for t in training}
    lines += [""]
    for cached in (False, True):
        ran = sorted(b for b, c in by if c == cached)
        if len(ran) > 1:
            small, large = ran[0], ran[-1]
            lines.append(f"- {'Cached' if cached else 'Direct'}: peak at {large:,} is "
                         f"{by[large, cached]['peak_mb'] / by[small, cached]['peak_mb']:.2f}x the peak at {small:,}.")
    for batch in sorted({b for b, _ in by}):
        if (batch, False) in by and (batch, True) in by:
            ratio = by[batch, True]["step_s"] / by[batch, False]["step_s"]
            lines.append(f"- B = {batch:,}: the cached step takes {ratio:.2f}x the direct step's time; step-1 losses "
                         f"{by[batch, False]['losses'][0]:.6f} (direct) and "
                         f"{by[batch, True]['losses'][0]:.6f} (cached).")
    lines += ["", "## InfoNCE + AnglE in-batch negatives, forward and backward", "",
              "| B | form | seconds | peak RSS per worker | before the loss |", "|---|---|---|---|---|"]
    for x in losses:
        lines.append(f"| {x['batch']:,} | {x['form']} | {x['seconds']:.1f} | {_mb(x['peak_mb'])} | {_mb(x['before_mb'])} |")
    projection = _projection(losses)
    if projection:
        lines += ["", "## 512 rows per GPU, worked out from the figures above", "",
                  "| GPUs | B | dense, per GPU | tiled, per GPU |", "|---|---|---|---|"]
        for p in projection:
            lines.append(f"| {p['gpus']} | {p['batch']:,} | {_mb(p['dense_mb'])} | {_mb(p['tiled_mb'])} |")
    write_results("batch_scale", {"machine": machine(), "chunk": args.chunk, "training": training, "losses": losses,
                                  "projection": projection}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
