"""Data at scale: what a training worker holds, and how long a run takes to reach its first optimizer step, as the
corpus grows.

  python benchmarks/data_scale.py [--rows 20000 1000000 3000000] [--before REV] [--workers 2]

For each corpus size, synthetic NLI pairs with S (about 200 bytes of text a pair, written once under the cache
folder) go through the tiny Stage 1 job (``configs/tiny/stage1.yaml``, tiny:bert, 3 steps) on ``--workers`` Ray
Train workers, started as a user starts it (``python ray_jobs/stage1.py``) with its own local Ray. The process tree
is sampled every 0.25 s: peak RSS and USS (memory no other process shares) of each Ray Train worker, the peak of all
Ray and job processes together, and the seconds from start to the first step's progress line. ``--before REV`` runs
the same measurement on a checkout of REV (a git worktree, this checkout's .venv) in the same run, for the
before/after table. Results: ``benchmarks/results/data_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, machine, write_results  # noqa: E402

CACHE = Path(os.environ.get("RAOE_BENCH_CACHE", Path(tempfile.gettempdir()) / "raoe_data_scale"))
WORDS = ("a man woman child dog group people player crowd girl boy worker is are was holding running sitting "
         "playing eating walking riding reading near in on at the with outside inside park street water beach "
         "ball bike book car table house field city market music camera hat shirt red blue green small large").split()
LABELS = ("entailment", "neutral", "contradiction")


def synthetic_pairs(rows: int) -> Path:
    """``rows`` NLI pairs with S as JSONL (text1 about 120 characters, text2 about 80), written once."""
    path = CACHE / f"nli_pairs_{rows}.jsonl"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    rng = random.Random(rows)
    partial = path.with_suffix(".partial")
    with partial.open("w", encoding="utf-8") as out:
        for _ in range(rows):
            text1 = " ".join(rng.choices(WORDS, k=22)) + "."
            text2 = " ".join(rng.choices(WORDS, k=14)) + "."
            out.write(json.dumps({"text1": text1, "text2": text2, "label": rng.choice(LABELS),
                                  "similarity": round(rng.random(), 4)}) + "\n")
    partial.rename(path)
    return path


def _tree(root_pid: int):
    import psutil

    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sample(root_pid: int, peaks: dict, stop: threading.Event) -> None:
    import psutil

    while not stop.is_set():
        total = 0
        for proc in _tree(root_pid):
            try:
                rss = proc.memory_info().rss
                total += rss
                if "RayTrainWorker" in " ".join(proc.cmdline()):
                    worker = peaks["workers"].setdefault(proc.pid, {"rss": 0, "uss": 0})
                    worker["rss"] = max(worker["rss"], rss)
                    worker["uss"] = max(worker["uss"], proc.memory_full_info().uss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        peaks["total"] = max(peaks["total"], total)
        stop.wait(0.25)


def run_job(checkout: Path, data: Path, workers: int, work: Path, run_name: str) -> dict:
    """The tiny Stage 1 job on ``data`` from ``checkout``; peak memory and time to the first step. Runs sharing
    ``work`` share the storage folder, and so the corpus cache."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "RAOE_HOME": str(work / "home"),
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "ray_jobs/stage1.py", "--config", "configs/tiny/stage1.yaml",
               "--set", f"data.train={data}", "--set", f"trainer.num_workers={workers}",
               "--set", "trainer.global_batch_size=32", "--set", "trainer.max_steps=3",
               "--set", "trainer.eval_every=100", "--set", f"output_dir={work / 'outputs'}",
               "--set", f"trainer.storage_path={work / 'runs'}", "--set", f"tracking.run_name={run_name}"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peaks, stop = {"workers": {}, "total": 0}, threading.Event()
    sampler = threading.Thread(target=_sample, args=(proc.pid, peaks, stop), daemon=True)
    sampler.start()
    first_step, tail, waits, cache = None, [], [], None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if first_step is None and re.search(r"\[raoe\] step 1/", line):
            first_step = time.perf_counter() - started
        if line.startswith('{"job"'):
            cache = json.loads(line).get("corpus_cache")
        wait = re.search(r"data wait ([0-9.]+) ms", line)
        if wait:
            waits.append(float(wait.group(1)))
    code = proc.wait()
    stop.set()
    sampler.join()
    if code != 0:
        raise RuntimeError(f"the job failed ({code}) in {checkout}:\n{''.join(tail)}")
    workers_peak = list(peaks["workers"].values())
    return {"first_step_s": round(first_step, 1) if first_step else None,
            "job_s": round(time.perf_counter() - started, 1),
            "worker_rss_mb": round(max(w["rss"] for w in workers_peak) / 2**20),
            "worker_uss_mb": round(max(w["uss"] for w in workers_peak) / 2**20),
            "all_processes_mb": round(peaks["total"] / 2**20),
            "data_wait_ms": waits, "corpus_cache": cache}


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="raoe_before_")) / "checkout"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), rev], cwd=ROOT, check=True)
    (path / ".venv").symlink_to(ROOT / ".venv")
    return path


def render(results: list[dict], workers: int, before: str | None) -> str:
    lines = ["# Data at scale: worker memory and time to the first step", "",
             f"Tiny Stage 1 job, {workers} Ray Train workers, synthetic NLI pairs (~200 bytes of text each), "
             f"3 steps of 32; `python benchmarks/data_scale.py` on {machine()['cpus']} CPUs"
             + (f"; before = {before}" if before else "") + ". RSS counts the object-store pages a worker maps "
             "(shared by the node's workers); USS is what the worker alone holds.", "",
             "| pairs | design | peak RSS per worker (MB) | peak USS per worker (MB) | all processes (MB) | "
             "first step (s) | job (s) | corpus cache |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']:,} | {r['design']} | {r['worker_rss_mb']} | {r['worker_uss_mb']} | "
              f"{r['all_processes_mb']} | {r['first_step_s']} | {r['job_s']} | {r.get('corpus_cache') or '-'} |"
              for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 1_000_000, 3_000_000])
    parser.add_argument("--before", help="git revision of the design to compare with (run in a worktree)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--append", action="store_true",
                        help="keep the results of other corpus sizes already in benchmarks/results/data_scale.json")
    args = parser.parse_args()
    designs = {"after": ROOT}
    if args.before:
        designs = {"before": worktree(args.before), **designs}
    results = []
    try:
        for rows in args.rows:
            data = synthetic_pairs(rows)
            for design, checkout in designs.items():
                with tempfile.TemporaryDirectory(prefix="raoe_scale_") as work:
                    # after: a second run over the same files (a sweep trial, a resubmission) reads the corpus cache
                    for name in (design, f"{design}, second run") if design == "after" else (design,):
                        print(f"[bench] {rows} pairs, {name} ...", flush=True)
                        out = run_job(checkout, data, args.workers, Path(work), name.replace(", ", "-").replace(" ", "-"))
                        print(f"[bench] {rows} pairs, {name}: {out}", flush=True)
                        results.append({"rows": rows, "design": name, **out})
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(designs["before"])], cwd=ROOT, check=False)
    if args.append and (RESULTS / "data_scale.json").exists():
        earlier = json.loads((RESULTS / "data_scale.json").read_text())
        results = sorted([r for r in earlier["results"] if r["rows"] not in args.rows] + results,
                         key=lambda r: r["rows"])
        args.before = args.before or earlier.get("before")
    path = write_results("data_scale", {"machine": machine(), "before": args.before, "workers": args.workers,
                                        "results": results}, render(results, args.workers, args.before))
    print(path.read_text())


if __name__ == "__main__":
    main()
