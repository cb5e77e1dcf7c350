"""The retrieval recipe end to end, through `ray job submit` on a local head as a user runs it:

  evaluate the student  ->  mine hard negatives with it (configs/retrieval/mine-snli-minilm-cpu.yaml)
  ->  supervised InfoNCE on the mined rows (configs/retrieval/stage1-infonce-mined-cpu.yaml)  ->  evaluate again

Mining: SNLI dev's (premise, entailment hypothesis) pairs among every distinct SNLI dev hypothesis. Evaluation:
the offline BEIR tasks of scripts/make_beir_sets.py (SNLI *test* premises retrieving their entailments among 9,639
hypotheses, STS-B dev sentence 1 retrieving sentence 2 among 1,467) and STS-B dev Spearman. Nothing of SNLI test is
trained on. Results: ``benchmarks/results/retrieval_recipe.{json,md}``.

  python benchmarks/retrieval_recipe.py [--max-rows 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402
from runtime.local_head import LocalHead, head_env  # noqa: E402
from scripts.demo import find_data_dir, submit  # noqa: E402
from scripts.make_beir_sets import make_sets  # noqa: E402

STUDENT = "pypi:all-minilm-l6-v2"
MINE, TRAIN = "configs/retrieval/mine-snli-minilm-cpu.yaml", "configs/retrieval/stage1-infonce-mined-cpu.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rows", type=int, default=0, help="cap on SNLI dev rows read for mining (0: all)")
    args = parser.parse_args()
    data = find_data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = head_env({"HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
                        "RAOE_MLFLOW_ARTIFACTS": str(tmp / "artifacts"), "RAOE_CACHE": str(tmp / "cache")})
        beir = make_sets(data, tmp / "beir")
        evaluate = ["ray_jobs/evaluate.py", "--config", "configs/retrieval/evaluate.yaml",
                    "--set", f"eval.data_dir={data / 'senteval'}", "--set", "eval.tasks=[STSBenchmark]",
                    "--set", "eval.stsb_split=dev", "--set", f"output_dir={tmp / 'eval'}",
                    "--set", f"eval.retrieval=[{', '.join(str(p) for p in beir.values())}]"]
        cap = ["--set", f"data.max_rows={args.max_rows}"] if args.max_rows else []
        timings = {}
        with LocalHead(env) as head:
            started = time.time()
            before = submit(head, env, evaluate + ["--set", f"model.source={STUDENT}"])
            timings["evaluate student"] = time.time() - started
            started = time.time()
            mined = submit(head, env, ["ray_jobs/mine_negatives.py", "--config", MINE,
                                       "--set", f"data.train={data / 'snli'}", "--set", f"output_path={tmp / 'mined'}",
                                       *cap])
            timings["mine"] = time.time() - started
            started = time.time()
            trained = submit(head, env, ["ray_jobs/stage1.py", "--config", TRAIN,
                                         "--set", f"data.train={mined['output_path']}",
                                         "--set", f"eval.data_dir={data / 'senteval'}",
                                         "--set", f"trainer.storage_path={tmp / 'runs'}",
                                         "--set", f"output_dir={tmp / 'models'}"])
            timings["train"] = time.time() - started
            started = time.time()
            after = submit(head, env, evaluate + ["--set", f"model.source={trained['model_uri']}"])
            timings["evaluate trained"] = time.time() - started
    report(before, mined, trained, after, timings, list(beir))


def report(before: dict, mined: dict, trained: dict, after: dict, timings: dict, tasks: list[str]) -> None:
    rows = {"student": before, f"trained ({trained['metrics']['steps']} steps)": after}
    payload = {"machine": machine(), "student": STUDENT, "retrieval": {k: v["retrieval"] for k, v in rows.items()},
               "stsb_dev": {k: v["metrics"].get("STSBenchmark") for k, v in rows.items()},
               "mining": {k: mined[k] for k in ("rows_in", "pairs_in", "corpus_rows", "rows_written",
                                                "rows_without_negative", "candidates_dropped_by_margin")},
               "training": trained["metrics"], "seconds": timings}
    lines = ["# The retrieval recipe: mine with the student, train InfoNCE, evaluate", "",
             f"`{STUDENT}` mines SNLI dev (premise -> entailment) pairs among SNLI dev's hypotheses (top 30, relative "
             "margin 0.95, one negative per pair), then trains one epoch of supervised InfoNCE (tau 0.05, batch 64, "
             "lr 2e-5) on the mined rows; evaluated on SNLI *test* and STS-B dev, never trained on. "
             f"{os.cpu_count()} CPUs, every job through `ray job submit` on a local head.", "",
             "| model | " + " | ".join(f"{t} nDCG@10 | {t} Recall@10" for t in tasks) + " | STS-B dev Spearman |",
             "|---|" + "---|---|" * len(tasks) + "---|"]
    for name, result in rows.items():
        cells = [f"{100 * result['retrieval'][t]['ndcg@10']:.2f} | {100 * result['retrieval'][t]['recall@10']:.2f}"
                 for t in tasks]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {result['metrics'].get('STSBenchmark', float('nan')):.2f} |")
    lines += ["", f"Mining: {mined['rows_in']:,} rows read, {mined['pairs_in']:,} (query, positive) pairs, corpus "
              f"{mined['corpus_rows']:,} texts, {mined['rows_written']:,} rows written, "
              f"{mined['rows_without_negative']:,} pairs without a negative, {mined['candidates_dropped_by_margin']:,} "
              "candidates dropped by the margin.", "",
              "Seconds (each job's wall time through ray job submit): "
              + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + "."]
    print(write_results("retrieval_recipe", payload, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
