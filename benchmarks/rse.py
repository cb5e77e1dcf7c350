"""RSE on this machine: the MiniLM student trained by ray_jobs/relational.py on SNLI dev+test entailment triples
(contradiction hard negatives) plus same-sent (configs/relational/minilm-snli-cpu.yaml), scored on STS-B dev and
STS12 with the plain cosine of its embeddings and with relation scores (entailment; entailment + same-sent), next to
the student; relation prediction (MRR, Hits@k) on the 200 held-out triples per relation.

  python benchmarks/rse.py [--steps 120]

A benchmark, not a test: about 20 minutes here.
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
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))
SENTEVAL = DATA / "senteval"
WEIGHTINGS = {"entailment": {"entailment": 1.0}, "entailment + same-sent": {"entailment": 1.0, "same-sent": 1.0}}


def scores(model_path: str) -> dict[str, dict[str, float]]:
    """STS-B dev and STS12: plain cosine, and for an RSE model each relation weighting."""
    from encoders.backbone import inference_embeddings, load_encoder
    from encoders.relational import read_relation_table
    from evaluation.sts import evaluate_sts, relation_sts_scorer

    model = load_encoder(model_path)
    cache: dict[str, object] = {}

    def encode(texts):
        missing = [t for t in texts if t not in cache]
        if missing:
            cache.update(zip(missing, inference_embeddings(model, missing, 128)))
        return [cache[t] for t in texts]

    saved = read_relation_table(model_path)
    ways = {"plain cosine": None, **({name: relation_sts_scorer(*saved, w) for name, w in WEIGHTINGS.items()}
                                     if saved else {})}
    out = {}
    for name, score in ways.items():
        dev = evaluate_sts(encode, SENTEVAL, ["STSBenchmark"], stsb_split="dev", score=score)["STSBenchmark"]
        sts12 = evaluate_sts(encode, SENTEVAL, ["STS12"], score=score)["STS12"]
        out[name] = {"stsb_dev": dev, "sts12": sts12}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of 64 triples")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.common import machine, write_results
    from encoders.model_uris import resolve_model
    from jobconfig import load_config
    from jobconfig.schema import RelationalJobConfig
    from training.run import run_training

    out: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(workdir / "artifacts")
        snli = DATA / "snli"
        cfg = load_config(RelationalJobConfig, ROOT / "configs/relational/minilm-snli-cpu.yaml", [
            f"data.train={snli}", f"eval.data_dir={SENTEVAL}", f"trainer.max_steps={args.steps}",
            f"trainer.storage_path={workdir / 'runs'}", f"output_dir={workdir / 'models'}",
            "tracking.experiment=raoe-bench-rse",
            f"data.sources=[{{train: {snli}, format: senteval_nli, split: test, mapping: nli}}, "
            f"{{train: {snli}, format: senteval_nli, split: dev, mapping: same-sent, max_rows: 2000, shuffle_seed: 0}}]"])
        job = run_training(cfg, register=False)
        out["job"] = {k: job[k] for k in ("relations", "relation_prediction", "seconds", "rows_written", "plan")}
        out["job"]["best_step"] = job["metrics"]["best_step"]
        out["rse"] = scores(job["model_path"])
        plot = Path(job["relation_similarity_plot"]).read_bytes()
    out["student"] = scores(resolve_model("pypi:all-minilm-l6-v2"))
    results_dir = ROOT / "benchmarks" / "results"
    (results_dir / "rse_relations.png").write_bytes(plot)
    j = out["job"]
    lines = [
        "# RSE: relational sentence embeddings from the MiniLM student on SNLI (configs/relational/minilm-snli-cpu.yaml)",
        "", f"Machine: {machine()}.", "",
        f"Training triples per relation: {j['relations']}; {j['plan']['total_steps']} steps of "
        f"{j['plan']['global_batch']} triples, best checkpoint by STS-B dev (entailment score) at step "
        f"{j['best_step']}; {j['seconds']:.0f} s.", "",
        "| model | score | STS-B dev | STS12 |", "|---|---|---|---|",
        *[f"| student | {name} | {v['stsb_dev']:.2f} | {v['sts12']:.2f} |" for name, v in out["student"].items()],
        *[f"| RSE | {name} | {v['stsb_dev']:.2f} | {v['sts12']:.2f} |" for name, v in out["rse"].items()], "",
        "Relation prediction on the held-out triples (every held-out tail a candidate, filtered):", "",
        "| relation | triples | candidates | MRR | Hits@1 | Hits@3 | Hits@10 |", "|---|---|---|---|---|---|---|",
        *[f"| {rel} | {v['triples']} | {v['candidates']} | {v['mrr']:.3f} | {v['hits@1']:.3f} | {v['hits@3']:.3f} | "
          f"{v['hits@10']:.3f} |" for rel, v in j["relation_prediction"].items()], "",
        "Relation vectors' cosine matrix: rse_relations.png.", "",
    ]
    md = "\n".join(lines)
    path = write_results("rse", out, md)
    print(md)
    print(json.dumps({"benchmark": "rse", "results": str(path)}))


if __name__ == "__main__":
    main()
