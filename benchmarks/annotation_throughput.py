"""Teacher-scored pairs per second through the annotation job (Ray Data actor pools) against the same
teachers encoding the same sentences directly in one process, in the same session.

  python benchmarks/annotation_throughput.py [--quick] [--config configs/annotate/snli-dev-test.yaml]

--quick scores the first 1,000 pairs of each split; the full run scores SNLI dev+test (19.7k pairs).
Both sides include model loading; the job side also includes Ray start-up, validation and writing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_job(config: str, max_rows: int | None, out: Path) -> dict:
    cmd = [sys.executable, "ray_jobs/annotate.py", "--config", config, "--set", f"output_dir={out}"]
    if max_rows:
        cmd += ["--set", f"data.max_rows={max_rows}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"annotate job failed:\n{proc.stderr[-3000:]}")
    # The actors' own progress lines: pairs/s since their teachers were loaded (the steady state, without Ray's and
    # the job's fixed start-up and finishing costs).
    rates = re.findall(r"\[raoe\] teacher \S+: \d+ pairs scored by this actor \(([\d.]+) pairs/s\)", proc.stdout)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_seconds": wall,
            "actor_pairs_per_second": float(rates[-1]) if rates else None}


def direct(config: str, output: str) -> dict:
    """Score the pairs the job wrote, with the same teachers, one process, no Ray."""
    import numpy as np
    import pandas as pd

    from data_pipelines.teachers import TeacherEncoder
    from jobconfig import load_config

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from annotate import AnnotateJobConfig  # the job's own config model

    cfg = load_config(AnnotateJobConfig, ROOT / config)
    frame = pd.read_parquet(output)
    t = time.perf_counter()
    scores = []
    for teacher in cfg.teachers:
        enc = TeacherEncoder(teacher)
        scores.append(enc.pair_cosines(frame["text1"].tolist(), frame["text2"].tolist()))
    seconds = time.perf_counter() - t
    s = np.clip(np.mean(scores, axis=0), 0, 1)
    return {"seconds": seconds, "pairs": len(frame), "max_abs_diff_S": float(np.abs(s - frame["similarity"]).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", default="configs/annotate/snli-dev-test.yaml")
    parser.add_argument("--keep", metavar="DIR", help="write the job's output here and keep it (e.g. the config's "
                        "output_dir, so the scored set can be trained on)")
    args = parser.parse_args()
    from benchmarks.common import machine, write_results

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        job = run_job(args.config, 1000 if args.quick else None, Path(args.keep or Path(tmp) / "out").resolve())
        ref = direct(args.config, job["output_path"])
    job_pps = job["rows_written"] / job["wall_seconds"]
    ref_pps = ref["pairs"] / ref["seconds"]
    headline = {
        "pairs": ref["pairs"], "job_wall_seconds": job["wall_seconds"], "job_pairs_per_second": job_pps,
        "direct_seconds": ref["seconds"], "direct_pairs_per_second": ref_pps, "ratio_job_over_direct": job_pps / ref_pps,
        "goal_ratio": 0.9, "max_abs_diff_S": ref["max_abs_diff_S"], "statistics": job["statistics"],
        "actor_pairs_per_second": job["actor_pairs_per_second"],
        "steady_ratio": job["actor_pairs_per_second"] / ref_pps if job["actor_pairs_per_second"] else None,
    }
    md = "\n".join([
        "# Annotation throughput: Ray Data teacher pools vs direct encoding", "",
        f"Machine: {machine()}; config {args.config}; {'quick (1,000 pairs per split)' if args.quick else 'full'}.", "",
        "| path | pairs | seconds | pairs/s |", "|---|---|---|---|",
        f"| annotate job (Ray Data, wall incl. start-up) | {job['rows_written']} | {job['wall_seconds']:.1f} "
        f"| {job_pps:.1f} |",
        f"| teachers directly, one process | {ref['pairs']} | {ref['seconds']:.1f} | {ref_pps:.1f} |", "",
        f"Ratio job/direct: {job_pps / ref_pps:.2f}x (goal >= 0.9x). Max |S_job - S_direct| = {ref['max_abs_diff_S']:.2e}.",
        "" if not headline["steady_ratio"] else
        f"Steady state (the scoring actor's own rate once its teachers are loaded, without Ray start-up, validation "
        f"and writing): {headline['actor_pairs_per_second']:.1f} pairs/s = {headline['steady_ratio']:.2f}x direct.",
        "", "S per label: " + ", ".join(f"{k}: mean {v['mean']:.3f} (std {v['std']:.3f}, n={v['count']})"
                                        for k, v in job["statistics"]["per_label"].items()), "",
    ])
    path = write_results("annotation_quick" if args.quick else "annotation", {"machine": machine(), **headline}, md)
    print(json.dumps({"benchmark": "annotation", "results": str(path), **headline}))


if __name__ == "__main__":
    main()
