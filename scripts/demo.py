"""`make demo`: run raoe's end-to-end path on this machine with the embedded defaults.

Today that path is the STS evaluation job: a local Ray (loopback only), the offline MiniLM student
encoded by a Ray Data actor pool, SentEval-layout STS data, results in a local MLflow store.
Training (Stage 1/2) joins the demo when the training service lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def find_data_dir() -> Path:
    base = Path(os.environ.get("DATA_DIR", ROOT.parent / "shared" / "data"))
    senteval = base / "senteval" if (base / "senteval").exists() else base
    if not (senteval / "STS").exists():
        sys.exit(f"demo: no SentEval-layout STS data under {base}; set DATA_DIR to a folder holding senteval/STS")
    return senteval


def run_job(args: list[str]) -> dict:
    """Run a job, stream its output, return its JSON result line."""
    print("$ python " + " ".join(args), flush=True)
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stdout:
        print("  " + line, end="", flush=True)
        if line.strip():
            last = line
    if proc.wait() != 0:
        sys.exit(f"demo: job failed with exit code {proc.returncode}")
    return json.loads(last)


def main() -> None:
    started = time.time()
    data = find_data_dir()
    print(f"[demo 1/1] STS evaluation of the offline MiniLM student (data: {data})", flush=True)
    result = run_job([
        "ray_jobs/evaluate.py", "--config", "configs/evaluate/sts.yaml",
        "--set", f"eval.data_dir={data}", "--set", "eval.stsb_split=dev",
        "--set", "tracking.run_name=demo-student",
    ])
    print("\nmodel: all-MiniLM-L6-v2 as shipped (STSBenchmark here = the dev split)")
    for task, value in result["metrics"].items():
        print(f"  {task:<18}{'absent (no files)' if value is None else f'{value:6.2f}'}")
    print(f"\nMLflow store: {result['tracking_uri']}  (open with: .venv/bin/mlflow ui --backend-store-uri "
          f"{result['tracking_uri']} --host 127.0.0.1)")
    print(f"demo finished in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
