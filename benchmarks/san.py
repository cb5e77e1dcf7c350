"""SAN on this machine: (1) generation throughput of the LLM path (SmolLM2-135M) called directly in one process
vs the generate_san job's actor pool with 1 and 2 actors, and (2) unsupervised SimCSE vs SimCSE+SAN (HiNCE) from
the MiniLM student at equal steps on the same SNLI sentences, scored on STS-B dev and STS12.

  python benchmarks/san.py [--sentences 480] [--throughput-sentences 64] [--steps 30]

The negatives come from configs/generate_san/snli-llm-cpu.yaml (a few-shot prompt: SmolLM2-135M does not follow
the paper's Table 12 instruction). A benchmark, not a test: about half an hour here.
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
sys.path.insert(0, str(ROOT / "ray_jobs"))
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))
CONFIG = ROOT / "configs" / "generate_san" / "snli-llm-cpu.yaml"


def generate(workdir: Path, name: str, sentences: int, actors: int, batch_rows: int = 256) -> dict:
    from generate_san import GenerateSanJobConfig, main

    from jobconfig import load_config

    threads = 2 // actors
    cfg = load_config(GenerateSanJobConfig, CONFIG, [
        f"data.train={DATA / 'snli'}", f"data.max_rows={sentences}", f"output_dir={workdir / name}",
        f"san.actors={actors}", f"san.cpus_per_actor={0.9 if actors > 1 else 1.0}", f"san.threads={threads}",
        "san.batch_size=16", f"batch_rows={batch_rows}", "tracking.experiment=raoe-bench-san"])
    return main(cfg)


def direct(sentences: list[str]) -> float:
    """Sentences per second of the same rewriter in this process (2 threads), no Ray."""
    import torch
    from generate_san import GenerateSanJobConfig

    from data_pipelines.san import LlmRewriter
    from encoders.sources import resolve_model_source
    from jobconfig import load_config

    torch.set_num_threads(2)
    cfg = load_config(GenerateSanJobConfig, CONFIG, ["san.batch_size=16"]).san
    rewriter = LlmRewriter(cfg, resolve_model_source(cfg.model))
    started = time.perf_counter()
    rewriter.rewrite(sentences)
    return len(sentences) / (time.perf_counter() - started)


def train(workdir: Path, name: str, data: Path, objective: str, steps: int, batch: int) -> dict:
    from jobconfig import load_config
    from jobconfig.schema import UnsupervisedJobConfig
    from training.run import run_training

    base = "minilm-snli-san-cpu.yaml" if objective == "hince" else "minilm-snli-simcse-cpu.yaml"
    cfg = load_config(UnsupervisedJobConfig, ROOT / "configs" / "unsupervised" / base, [
        f"data.train={data}", "data.format=auto", f"trainer.max_steps={steps}", f"trainer.global_batch_size={batch}",
        f"trainer.eval_every={max(1, steps // 3)}", "model.dropout=0.1", f"eval.data_dir={DATA / 'senteval'}",
        f"trainer.storage_path={workdir / 'runs'}", f"output_dir={workdir / 'models'}",
        f"tracking.run_name=san-bench-{name}", "tracking.experiment=raoe-bench-san"])
    started = time.perf_counter()
    result = run_training(cfg, register=False)
    return {"model_path": result["model_path"], "steps": result["metrics"]["steps"],
            "best_step": result["metrics"]["best_step"], "train_seconds": time.perf_counter() - started}


def _throughput_table(out: dict) -> list[str]:
    tp1, tp2 = out["job_1_actors"]["sentences_per_second"], out["job_2_actors"]["sentences_per_second"]
    direct_rate = out["direct_sentences_per_second"]
    return [
        "# SAN generation throughput", "",
        "## Generation throughput (SmolLM2-135M, few-shot prompt, greedy, 30 new tokens, batches of 16)", "",
        "| path | sentences/s | ratio to direct |", "|---|---|---|",
        f"| direct, one process, 2 threads | {direct_rate:.2f} | 1.00 |",
        f"| job, 1 actor x 2 threads (wall, incl. Ray start, reading, model load) | {tp1:.2f} | {tp1 / direct_rate:.2f} |",
        f"| job, 2 actors x 1 thread (wall) | {tp2:.2f} | {tp2 / direct_rate:.2f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=480, help="SNLI dev sentences given negatives for training")
    parser.add_argument("--throughput-sentences", type=int, default=64, help="sentences per throughput measurement")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each unsupervised run")
    parser.add_argument("--batch", type=int, default=32, help="sentences per step")
    parser.add_argument("--throughput-only", action="store_true", help="only the generation throughput rows")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.common import machine, write_results
    from benchmarks.quality import score

    out: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(workdir / "artifacts")
        import pandas as pd

        from data_pipelines.formats import parse

        pool = [r["text"] for r in parse("sentences", "senteval_nli", DATA / "snli", "dev") if r["error"] is None]
        n = args.throughput_sentences
        out["direct_sentences_per_second"] = direct(pool[:n])
        print(f"[bench] direct: {out['direct_sentences_per_second']:.2f} sentences/s", flush=True)
        for actors in (1, 2):
            result = generate(workdir, f"tp{actors}", n, actors, batch_rows=16)  # 16-sentence blocks for every actor
            out[f"job_{actors}_actors"] = {k: result[k] for k in ("sentences_per_second", "seconds", "rows_written",
                                                                  "rows_guarded", "guarded")}
            print(f"[bench] job, {actors} actor(s): {out[f'job_{actors}_actors']}", flush=True)
        if args.throughput_only:
            write_results("san_throughput", out, "\n".join(_throughput_table(out)) + "\n")
            print(json.dumps(out))
            return
        san = generate(workdir, "train", args.sentences, 1)
        out["negatives"] = {k: san[k] for k in ("rows_in", "rows_written", "rows_with_negative", "rows_guarded", "guarded",
                                                "changed_share_by_pos", "mean_token_overlap", "sentences_per_second")}
        frame = pd.read_parquet(san["output_path"])
        out["examples"] = frame[frame["negative"].notna()][["text", "negative"]].head(8).to_dict("records")
        print(f"[bench] negatives: {out['negatives']}", flush=True)
        # Equal data for both: every anchor (guarded ones without a negative), SimCSE ignoring the negatives.
        runs = {}
        for name, objective in (("simcse", "infonce"), ("simcse+san", "hince")):
            run = train(workdir, name, Path(san["output_path"]), objective, args.steps, args.batch)
            runs[name] = {**run, **score(run["model_path"])}
            runs[name].pop("model_path")
            print(f"[bench] {name}: {runs[name]}", flush=True)
        runs["student"] = score("pypi:all-minilm-l6-v2")
        out["training"] = runs
    lines = [
        "# SAN: LLM negatives (SmolLM2-135M) and SimCSE vs SimCSE+SAN from the MiniLM student", "",
        f"Machine: {machine()}.", "", *_throughput_table(out)[1:], "",
        f"## Negatives for training ({args.sentences} SNLI dev sentences)", "",
        f"written {san['rows_written']} ({san['rows_with_negative']} with a negative, {san['rows_guarded']} guarded "
        f"{san['guarded']}); mean word overlap "
        f"{san['mean_token_overlap']:.3f}; share of words changed by POS: {san['changed_share_by_pos']}", "",
        *[f"- {e['text']} -> {e['negative']}" for e in out["examples"]], "",
        f"## Unsupervised training, {args.steps} steps x {args.batch}, lr 3e-5, dropout 0.1 (p2 0.2, tau2 0.08)", "",
        "| row | STS-B dev | STS12 | steps | train s |", "|---|---|---|---|---|",
        *[f"| {k} | {v['stsb_dev']:.2f} | {v['sts12']:.2f} | {v.get('steps', 0)} | {v.get('train_seconds', 0):.0f} |"
          for k, v in out["training"].items()], "",
    ]
    md = "\n".join(lines)
    path = write_results("san", out, md)
    print(md)
    print(json.dumps({"benchmark": "san", "results": str(path)}))


if __name__ == "__main__":
    main()
