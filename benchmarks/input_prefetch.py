"""Input off the critical path: how long each training step waits for its input, with and without the prefetch.

  python benchmarks/input_prefetch.py [--steps 20] [--batch 64 256] [--repeats 2]

The Stage 2 job (the MiniLM student, STS-B train, CoSENT, max length 48, 2 torch threads, one Ray Train worker) runs
``--steps`` steps with ``data.prefetch`` true (the next micro-batch's rows taken and tokenised in a background
thread) and false (both in the step), in turn, ``--repeats`` times each; the best run of each counts. From the
loop's MLflow metrics: the steady-state step time (the first two steps untimed) and ``data_wait_s``, the time each
step waited for its input, as a share of the step. Results: ``benchmarks/results/input_prefetch.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402
from benchmarks.training_throughput import MAX_LENGTH, MODEL, STSB, THREADS, WARMUP_STEPS, load_pairs, stage2_config  # noqa: E402


def run(frame, steps: int, batch: int, prefetch: bool, workdir: Path) -> dict:
    from mlflow import MlflowClient

    from training.run import run_training

    cfg = stage2_config(frame, steps, batch, workdir, f"data.prefetch={prefetch}", "data.cache=false",
                        "tracking.run_name=prefetch")
    result = run_training(cfg, register=False)
    client = MlflowClient()
    rate = {m.step: m.value for m in client.get_metric_history(result["run_id"], "pairs_per_second")}
    waits = {m.step: m.value for m in client.get_metric_history(result["run_id"], "data_wait_s")}
    elapsed = {step: batch * step / value for step, value in rate.items()}  # seconds since the loop started
    timed = [s for s in sorted(elapsed) if s > WARMUP_STEPS]
    step_s = (elapsed[timed[-1]] - elapsed[WARMUP_STEPS]) / len(timed)
    wait_s = sum(waits[s] for s in timed) / len(timed)
    return {"step_ms": step_s * 1000, "data_wait_ms": wait_s * 1000, "wait_share": wait_s / step_s,
            "first_step_wait_ms": waits[1] * 1000, "steps": max(elapsed)}


def tokenise_ms(frame, batch: int) -> float:
    """What tokenising one step's texts costs on its own (the two length buckets of 2 x batch texts)."""
    import time

    from encoders.backbone import TokenCache, build_encoder
    from encoders.sources import resolve_model_source

    model = build_encoder(resolve_model_source(MODEL), pooling="mean", max_length=MAX_LENGTH)
    texts = list(frame["sentence1"][:batch]) + list(frame["sentence2"][:batch])
    cache, best = TokenCache(), float("inf")
    for _ in range(5):
        started = time.perf_counter()
        cache.prepare(model, [(texts, 2)])
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="pairs per optimizer step")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, best kept")
    args = parser.parse_args()
    if not STSB.exists():
        sys.exit(f"needs STS-B train at {STSB} (set RAOE_DEV_DATA)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            frame = load_pairs(args.steps * batch)
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for i in range(args.repeats):
                for prefetch in (True, False):
                    print(f"[bench] batch {batch}, prefetch {prefetch} (run {i + 1}/{args.repeats}) ...", flush=True)
                    runs[prefetch].append(run(frame, args.steps, batch, prefetch, Path(tmp) / f"{batch}-{prefetch}-{i}"))
                    print(f"[bench] {runs[prefetch][-1]}", flush=True)
            best = {p: min(r, key=lambda x: x["step_ms"]) for p, r in runs.items()}
            rows.append({"batch": batch, "tokenise_ms": tokenise_ms(frame, batch),
                         "prefetch": best[True], "in_step": best[False],
                         "all_step_ms": {str(p): [round(x["step_ms"], 1) for x in r] for p, r in runs.items()}})
    lines = ["# Input off the critical path: data wait per step with and without the prefetch", "",
             f"Machine: {machine()}. The Stage 2 job, MiniLM-L6 student, STS-B train, CoSENT, max length "
             f"{MAX_LENGTH}, {THREADS} torch threads, 1 Ray Train worker, {args.steps} steps ({WARMUP_STEPS} "
             f"untimed), best of {args.repeats} runs each, run in turn.", "",
             "| batch | tokenising one step alone | step, prefetch | data wait, prefetch | step, in the step | "
             "data wait, in the step |", "|---|---|---|---|---|---|"]
    for r in rows:
        p, s = r["prefetch"], r["in_step"]
        lines.append(f"| {r['batch']} | {r['tokenise_ms']:.1f} ms | {p['step_ms']:.0f} ms | {p['data_wait_ms']:.2f} ms "
                     f"({p['wait_share']:.2%}) | {s['step_ms']:.0f} ms | {s['data_wait_ms']:.2f} ms "
                     f"({s['wait_share']:.2%}) |")
    lines += ["", "Every run's step time (ms): " + "; ".join(f"batch {r['batch']}: {r['all_step_ms']}" for r in rows),
              ""]
    path = write_results("input_prefetch", {"machine": machine(), "steps": args.steps, "rows": rows},
                         "\n".join(lines))
    print("\n".join(lines))
    print(json.dumps({"benchmark": "input_prefetch", "results": str(path), "rows": rows}))


if __name__ == "__main__":
    main()
