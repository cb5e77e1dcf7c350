"""Where Ray Train's step overhead comes from: the training throughput benchmark's raoe paths (the bare step on the
plan's permutation of the file's rows, the bare step on the very rows the job's step takes, the job's loop in its own
process, the loop on one Ray Train worker), interleaved, once under Ray's default worker niceness (15: Ray starts its
worker processes at a lower priority than the driver) and once at 0, each in a Ray of its own; and the one per-step
cost the loop adds to the bare step, the MLflow log of the step's metrics.

Same model, data, batch and threads as ``benchmarks/training_throughput.py`` (MiniLM-L6, STS-B train, batch 64,
max length 48, 2 torch threads). This VM's speed drifts by tens of percent over minutes, so each path runs
``--repeats`` times in turn and the table gives every run, the best and the median.
Results: ``benchmarks/results/ray_train_overhead.{json,md}``.

  python benchmarks/ray_train_overhead.py [--repeats 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NICENESS = (15, 0)  # Ray's default for its worker processes, and the driver's own
# the bare step on the plan's permutation of the file's rows, and on the job's own rows (its reader's content order):
# the same step with the same padded lengths as the job's
PATHS = ("raoe_bare", "raoe_bare_job_rows", "raoe_in_process", "raoe_ray")


def measure_paths(repeats: int, steps: int, batch: int) -> dict[str, list[float]]:
    """In this process (its Ray started with this environment's RAY_worker_niceness): every path ``repeats`` times,
    in turn; pairs/s of each run."""
    import benchmarks.training_throughput as throughput

    frame = throughput.load_pairs(steps * batch)
    runs: dict[str, list[float]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(tmp / "artifacts")
        job = throughput.job_rows(frame, steps, batch, tmp / "rows")  # read and content-ordered once
        for i in range(repeats):
            for name in PATHS:
                if name == "raoe_bare":
                    result = throughput.run_raoe_bare(frame, steps, batch)
                elif name == "raoe_bare_job_rows":
                    result = throughput.run_raoe_bare(frame, steps, batch, order="job", job=job)
                elif name == "raoe_in_process":
                    result = throughput.run_raoe_ray(frame, steps, batch, tmp / f"local-{i}", "trainer.num_workers=0")
                else:
                    result = throughput.run_raoe_ray(frame, steps, batch, tmp / f"ray-{i}")
                runs[name].append(round(result["pairs_per_second"], 2))
                print(f"[bench] niceness {os.environ['RAY_worker_niceness']} {name}: {runs[name]}", flush=True)
    return runs


def metrics_log_ms(steps: int = 30) -> float:
    """Median milliseconds of one step's metrics (7 values) logged to a local SQLite MLflow store, as the loop logs
    them every step."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    with tempfile.TemporaryDirectory() as tmp:
        client = MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        run_id = client.create_run(client.create_experiment("log", artifact_location=tmp)).info.run_id
        took = []
        for step in range(steps):
            metrics = [Metric(k, float(step), int(time.time() * 1000), step) for k in
                       ("train_loss", "grad_norm", "lr", "data_wait_s", "workers", "pairs_per_second", "loss/cosent")]
            started = time.perf_counter()
            client.log_batch(run_id, metrics=metrics)
            took.append(time.perf_counter() - started)
    return 1000 * statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path per niceness")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (2 untimed)")
    parser.add_argument("--batch", type=int, default=64, help="pairs per optimizer step")
    parser.add_argument("--paths-only", action="store_true", help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.paths_only:
        print("RESULT " + json.dumps(measure_paths(args.repeats, args.steps, args.batch)), flush=True)
        return
    by_niceness = {niceness: _paths_in_a_ray_of_their_own(niceness, args) for niceness in NICENESS}
    report(by_niceness, metrics_log_ms(), args)


def _paths_in_a_ray_of_their_own(niceness: int, args) -> dict[str, list[float]]:
    """measure_paths in a child process whose Ray starts its workers at ``niceness``; its progress lines shown as
    they come."""
    command = [sys.executable, __file__, "--paths-only", "--repeats", str(args.repeats), "--steps", str(args.steps),
               "--batch", str(args.batch)]
    with subprocess.Popen(command, env={**os.environ, "RAY_worker_niceness": str(niceness)}, stdout=subprocess.PIPE,
                          text=True) as child:
        result = None
        for line in child.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            elif line.startswith("[bench]"):
                print(line, end="", flush=True)
    if child.returncode != 0 or result is None:
        sys.exit(f"the paths at worker niceness {niceness} failed (exit code {child.returncode})")
    return result


def report(by_niceness: dict, log_ms: float, args) -> None:
    from benchmarks.common import machine, write_results

    best = {n: {p: max(r) for p, r in runs.items()} for n, runs in by_niceness.items()}
    median = {n: {p: statistics.median(r) for p, r in runs.items()} for n, runs in by_niceness.items()}
    lines = [
        "# Ray Train's step overhead: bare step, the job's loop in process, the loop on a Ray Train worker", "",
        f"Machine: {machine()}; MiniLM-L6, STS-B train, batch {args.batch}, max length 48, 2 torch threads, "
        f"{args.steps} steps per run (2 untimed); each path {args.repeats} times in turn, per Ray worker niceness "
        "(a Ray of its own each).", "",
        "| worker niceness | path | runs (pairs/s) | best | median |", "|---|---|---|---|---|"]
    for n, runs in by_niceness.items():
        for p, r in runs.items():
            lines.append(f"| {n} | {p} | {', '.join(f'{x:.2f}' for x in r)} | {best[n][p]:.2f} | {median[n][p]:.2f} |")
    ratios = (("raoe_bare", "raoe_ray"), ("raoe_bare_job_rows", "raoe_ray"), ("raoe_bare", "raoe_bare_job_rows"),
              ("raoe_bare_job_rows", "raoe_in_process"), ("raoe_in_process", "raoe_ray"))
    lines += ["", "Ratios of pairs/s, best run (median run):", "",
              "| worker niceness | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
              "|---|" + "---|" * len(ratios)]
    for n in by_niceness:
        b, m = best[n], median[n]
        lines.append(f"| {n} | " + " | ".join(f"{b[x] / b[y]:.3f}x ({m[x] / m[y]:.3f}x)" for x, y in ratios) + " |")
    step_ms = 1000 * args.batch / best[NICENESS[0]]["raoe_bare"]
    lines += ["", f"The loop's per-step MLflow log (7 metrics, local SQLite store): {log_ms:.1f} ms median, "
              f"{100 * log_ms / step_ms:.2f}% of a bare step ({step_ms:.0f} ms).", ""]
    path = write_results("ray_train_overhead", {"machine": machine(), "steps": args.steps, "batch": args.batch,
                                                "repeats": args.repeats, "runs": by_niceness, "best": best,
                                                "median": median, "metrics_log_ms": log_ms}, "\n".join(lines))
    print(path.read_text())


if __name__ == "__main__":
    main()
