"""Ranked-list generation throughput with 1 and 2 LM actors: the generate_lists job on SNLI dev premises with the
offline SmolLM2-135M, ``--seeds`` seeds (clusters x 1), ``--steps`` sentences each, no lam = 0 comparison.

  python benchmarks/list_actors.py [--seeds 16] [--steps 4]

1 actor x 2 torch threads against 2 actors x 1 thread (0.9 CPU each) on this 2-core machine; sentences generated
per second of the job's wall time (Ray start, reading, seed encoding and k-means included) and of its generation
phase alone (from the job's own log lines). Results: ``benchmarks/results/list_actors.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402

SETTINGS = {"1 actor x 2 threads": ("lists.actors=1", "lists.threads=2", "lists.cpus_per_actor=1.0"),
            "2 actors x 1 thread": ("lists.actors=2", "lists.threads=1", "lists.cpus_per_actor=0.9")}


def run(name: str, seeds: int, steps: int, workdir: Path) -> dict:
    args = [sys.executable, "ray_jobs/generate_lists.py", "--config", "configs/generate_lists/snli-smollm2-cpu.yaml",
            "--set", f"lists.clusters={seeds}", "--set", "lists.per_cluster=1", "--set", f"lists.steps={steps}",
            "--set", "lists.compare_lists=0", "--set", "lists.batch_size=4", "--set", f"output_dir={workdir / 'out'}",
            *[x for setting in SETTINGS[name] for x in ("--set", setting)]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
           "RAOE_MLFLOW_ARTIFACTS": str(workdir / "artifacts")}
    started, generating = time.perf_counter(), None
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if generating is None and "generating" in line and "[raoe]" in line:
            generating = time.perf_counter()
    proc.wait()
    ended = time.perf_counter()
    result = json.loads(lines[-1])
    if proc.returncode or result.get("status") != "ok":
        raise RuntimeError(f"{name}: {result}")
    sentences = result["sentences"] - result["lists_written"]  # generated, not the seeds
    return {"setting": name, "sentences": sentences, "wall_s": ended - started, "generation_s": ended - generating,
            "sentences_per_s_wall": sentences / (ended - started),
            "sentences_per_s_generation": sentences / (ended - generating)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in SETTINGS:
            runs.append(run(name, args.seeds, args.steps, Path(tmp) / name.replace(" ", "_")))
            print(f"[bench] {runs[-1]}", flush=True)
    base = runs[0]["sentences_per_s_generation"]
    lines = ["# Ranked-list generation with 1 and 2 LM actors", "",
             f"Machine: {machine()}. generate_lists on SNLI dev premises, SmolLM2-135M, {args.seeds} seeds x "
             f"{args.steps} sentences, batches of 4 seeds, no lam = 0 comparison.", "",
             "| setting | sentences | job wall | sentences/s (wall) | generation phase | sentences/s (generation) | "
             "vs 1 actor |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['sentences']} | {r['wall_s']:.0f} s | {r['sentences_per_s_wall']:.2f} | "
              f"{r['generation_s']:.0f} s | {r['sentences_per_s_generation']:.2f} | "
              f"{r['sentences_per_s_generation'] / base:.2f}x |" for r in runs]
    write_results("list_actors", {"machine": machine(), "seeds": args.seeds, "steps": args.steps, "runs": runs},
                  "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
