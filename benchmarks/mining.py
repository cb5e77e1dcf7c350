"""Hard-negative mining throughput: raoe's mine_negatives job against sentence-transformers' ``mine_hard_negatives``
on the same pairs, model and settings, in the same run.

  python benchmarks/mining.py [--pairs 0] [--actors 2]
  python benchmarks/mining.py --synthetic 100000 --only st,raoe-cold     # results: mining_100000.{json,md}
  python benchmarks/mining.py --synthetic 100000 --only raoe-cold,raoe-warm,raoe-warm-1 --name mining_100000_actors

Pairs: SNLI dev's (premise, entailment hypothesis) pairs (``--pairs`` caps them; 0 = all), or ``--synthetic N``
pairs made of them for scale: each a random SNLI dev entailment pair with the same random SNLI test sentence appended
to both sides (seeded; texts about twice SNLI's length, nearly all distinct). Corpus: their distinct positives (both
tools' default); the MiniLM student; top 30 candidates, a candidate kept when its score is at most 0.95 x the query's
lowest positive (``relative_margin: 0.05`` in both tools), one negative per pair. raoe runs in-process on a local Ray
with ``--actors`` encoder actors of 1 CPU each (its pool is how it uses the cores; sentence-transformers encodes in
this process with every core); its time counts everything from reading the pairs to writing the rows. Six
measurements, ``--only`` picks some: st, st-faiss (sentence-transformers exact, and with ``use_faiss``), raoe-cold
(exact search, a cold corpus index), raoe-warm (the index cached), raoe-faiss (``mining.search.method: faiss``), and
raoe-warm-1 (the index cached, one actor: what the actors add once the corpus is encoded; with ``--actors 1`` it is
raoe-warm).
Results: ``benchmarks/results/mining.{json,md}`` (``mining_<pairs>`` for synthetic pairs; ``--name`` another name, so
that a run of some rows keeps an earlier run's file).
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

from benchmarks.common import machine, write_results  # noqa: E402

SNLI = ROOT.parent / "shared" / "data" / "snli"
MODEL = "pypi:all-minilm-l6-v2"
TOP_K, MARGIN = 30, 0.95
RUNS = ("st", "st-faiss", "raoe-cold", "raoe-warm", "raoe-faiss", "raoe-warm-1")


def snli_pairs(limit: int, snli: Path = SNLI) -> list[dict]:
    s1 = (snli / "s1.dev").read_text(encoding="utf-8").splitlines()
    s2 = (snli / "s2.dev").read_text(encoding="utf-8").splitlines()
    labels = (snli / "labels.dev").read_text(encoding="utf-8").splitlines()
    seen, pairs = set(), []
    for a, b, label in zip(s1, s2, labels):
        if label.strip() == "entailment" and (a.strip(), b.strip()) not in seen:
            seen.add((a.strip(), b.strip()))
            pairs.append({"query": a.strip(), "positive": b.strip()})
    return pairs[:limit] if limit else pairs


def synthetic_pairs(n: int, seed: int = 0, snli: Path = SNLI) -> list[dict]:
    """``n`` pairs for scale: an SNLI dev entailment pair with one SNLI test sentence appended to both sides."""
    import random

    base = snli_pairs(0, snli)
    tails = sorted({line.strip() for line in (snli / "s2.test").read_text(encoding="utf-8").splitlines() if line.strip()})
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        pair, tail = rng.choice(base), rng.choice(tails)
        pairs.append({"query": f"{pair['query']} {tail}", "positive": f"{pair['positive']} {tail}"})
    return pairs


def run_raoe(pairs_file: Path, out: Path, actors: int, search: str = "exact") -> dict:
    import mine_negatives

    cfg = mine_negatives.MineJobConfig(
        data={"train": str(pairs_file)}, output_dir=str(out), actors=actors, cpus_per_actor=1.0,
        mining={"model": MODEL, "range_max": TOP_K, "relative_margin": round(1 - MARGIN, 6), "negatives_per_row": 1,
                "batch_size": 128, "queries_per_batch": 512, "search": {"method": search}},
        tracking={"experiment": "bench-mining"})
    started = time.time()
    result = mine_negatives.main(cfg)
    result["wall_s"] = time.time() - started
    rows = [json.loads(line) for f in sorted((out / "data").glob("*.json*")) for line in open(f)]
    result["negatives"] = {(r["query"], p): r["negatives"][0] for r in rows for p in r["positives"]}  # one group a query
    return result


def run_sentence_transformers(pairs: list[dict], use_faiss: bool = False) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from encoders.model_uris import resolve_model

    model = SentenceTransformer(resolve_model(MODEL), device="cpu")
    dataset = Dataset.from_list(pairs)
    started = time.time()
    mined = mine_hard_negatives(dataset, model, range_max=TOP_K, relative_margin=1 - MARGIN, num_negatives=1,
                                sampling_strategy="top", batch_size=128, use_faiss=use_faiss, verbose=False)
    seconds = time.time() - started
    negatives = {(r["query"], r["positive"]): r["negative"] for r in mined}
    return {"seconds": seconds, "rows_written": len(mined), "negatives": negatives}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=0, help="cap on SNLI dev entailment pairs (0: all)")
    parser.add_argument("--actors", type=int, default=2, help="raoe's encoder actors (1 CPU each)")
    parser.add_argument("--synthetic", type=int, default=0, help="pairs made from SNLI for scale (0: SNLI dev's own)")
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--name", default=None,
                        help="results name (default: mining, or mining_<pairs> with --synthetic)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if args.actors == 1 and "raoe-warm-1" in only:  # raoe-warm is that run
        only = (only - {"raoe-warm-1"}) | {"raoe-warm"}
    if only - set(RUNS) or "st" not in only and "raoe-cold" not in only:
        parser.error(f"--only: a subset of {','.join(RUNS)} holding st or raoe-cold (the reference rows)")
    if {"raoe-warm", "raoe-faiss", "raoe-warm-1"} & only and "raoe-cold" not in only:
        parser.error("--only: raoe-warm, raoe-faiss and raoe-warm-1 search the index raoe-cold builds: "
                     "name raoe-cold too")
    pairs = synthetic_pairs(args.synthetic) if args.synthetic else snli_pairs(args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(tmp / "artifacts")
        os.environ["RAOE_CACHE"] = str(tmp / "cache")  # a cold corpus index
        pairs_file = tmp / "pairs.jsonl"
        pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        measure = {"st": lambda: run_sentence_transformers(pairs),
                   "st-faiss": lambda: run_sentence_transformers(pairs, use_faiss=True),
                   "raoe-cold": lambda: run_raoe(pairs_file, tmp / "mined-cold", args.actors),
                   "raoe-warm": lambda: run_raoe(pairs_file, tmp / "mined-warm", args.actors),
                   "raoe-faiss": lambda: run_raoe(pairs_file, tmp / "mined-faiss", args.actors, search="faiss"),
                   "raoe-warm-1": lambda: run_raoe(pairs_file, tmp / "mined-warm-1", 1)}
        ran = {name: measure[name]() for name in RUNS if name in only}  # raoe-warm, -faiss and -warm-1 reuse cold's index
    n = len(pairs)
    names = {"st": "sentence-transformers mine_hard_negatives", "raoe-cold": "raoe mine_negatives (cold index)",
             "raoe-warm": "raoe mine_negatives (cached index)",
             "st-faiss": "sentence-transformers mine_hard_negatives, use_faiss",
             "raoe-faiss": "raoe mine_negatives, mining.search faiss (cached index)",
             "raoe-warm-1": "raoe mine_negatives (cached index), 1 actor"}
    table = {}
    for key in ("st", "raoe-cold", "raoe-warm", "raoe-warm-1", "st-faiss", "raoe-faiss"):
        if key in ran:
            seconds = ran[key]["wall_s"] if key.startswith("raoe") else ran[key]["seconds"]
            table[names[key]] = {"seconds": seconds, "pairs_per_s": n / seconds, "rows_written": ran[key]["rows_written"],
                                 **({"search_recall": ran[key].get("search_recall")} if key == "raoe-faiss" else {})}
    rate = {key: table[names[key]]["pairs_per_s"] for key in ran}
    cold = ran.get("raoe-cold")
    corpus = f"their {cold['corpus_rows']:,} distinct positives" if cold else "their distinct positives"
    source = (f"{n:,} synthetic pairs (an SNLI dev entailment pair with one SNLI test sentence appended to both sides)"
              if args.synthetic else f"SNLI dev entailment pairs: {n:,} (premise -> hypothesis)")
    payload = {"machine": machine(), "pairs": n, "synthetic": bool(args.synthetic),
               "corpus_rows": cold["corpus_rows"] if cold else None, "top_k": TOP_K, "margin": MARGIN,
               "raoe_actors": args.actors, "results": table}
    lines = ["# Hard-negative mining throughput", "",
             f"{source}; corpus: {corpus}; `{MODEL}`; range_max {TOP_K}, relative_margin {1 - MARGIN:.2f} against "
             f"each query's lowest positive, one negative, exact search; "
             f"{os.cpu_count()} CPUs; raoe with {args.actors} encoder actor(s) x 1 CPU (unless said) on a local Ray, "
             "timed from reading the pairs to writing the rows.", "",
             "| tool | seconds | pairs/s | rows written (sentence-transformers: triplets; raoe: query groups) |",
             "|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seconds']:.1f} | {row['pairs_per_s']:.1f} | {row['rows_written']:,} |")
    lines.append("")
    if "st" in rate and "raoe-cold" in rate:
        lines.append(f"- raoe / sentence-transformers, pairs/s: {rate['raoe-cold'] / rate['st']:.2f}x cold"
                     + (f", {rate['raoe-warm'] / rate['st']:.2f}x with the corpus index cached." if "raoe-warm" in rate
                        else "."))
    if "st-faiss" in rate and "raoe-faiss" in rate:
        lines.append(f"- With FAISS on both sides (sentence-transformers' `use_faiss`: a flat FAISS index, exact; "
                     f"raoe's `mining.search.method: faiss`: inverted lists, recall@{TOP_K} "
                     f"{ran['raoe-faiss'].get('search_recall', float('nan')):.4f} against exact search): raoe "
                     f"{rate['raoe-faiss'] / rate['st-faiss']:.2f}x sentence-transformers' pairs/s, raoe's corpus "
                     "index cached (sentence-transformers encodes its corpus in every run).")
    if "st-faiss" in rate and "raoe-cold" in rate:
        lines.append(f"- Cold against cold: raoe's exact search with its corpus encoded in the run "
                     f"{rate['raoe-cold'] / rate['st-faiss']:.2f}x sentence-transformers' `use_faiss` pairs/s.")
    if "raoe-warm" in rate and "raoe-warm-1" in rate:
        lines.append(f"- Once the corpus is encoded (index cached): {args.actors} actors "
                     f"{rate['raoe-warm'] / rate['raoe-warm-1']:.2f}x one actor's pairs/s.")
    if "st" in ran and cold:
        common = set(ran["st"]["negatives"]) & set(cold["negatives"])
        same = sum(ran["st"]["negatives"][k] == cold["negatives"][k] for k in common)
        payload.update(same_negative_share=same / max(1, len(common)), pairs_both_mined=len(common))
        lines.append(f"- Both mined a negative for {len(common):,} pairs; the same negative for "
                     f"{100 * same / max(1, len(common)):.1f}% of them (they differ where scores tie closely).")
    if cold:
        payload.update(raoe_rows_without_negative=cold["rows_without_negative"],
                       raoe_candidates_dropped_by_margin=cold["candidates_dropped_by_margin"],
                       raoe_positives_encoded=cold.get("positives_encoded"))
        lines.append(f"- raoe: {cold['rows_without_negative']:,} queries without a negative under the margin, "
                     f"{cold['candidates_dropped_by_margin']:,} candidates dropped by it; "
                     f"{cold.get('positives_encoded', 0):,} positives encoded beside the corpus (the others scored "
                     "from the index).")
    name = args.name or (f"mining_{n}" if args.synthetic else "mining")
    print(write_results(name, payload, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
