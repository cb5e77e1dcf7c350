"""Seed selection for ranked lists at scale: k-means over candidate-seed embeddings, exact against mini-batch.

  python benchmarks/kmeans_seeds.py [--rows 20000 100000 1000000] [--exact 1000 2000] [--clusters 1000]

Synthetic embeddings (384 dimensions, as the MiniLM seed encoder gives; 2,000 Gaussian topics, so clusters are
real) stand in for encoded premises: encoding is the seed encoder's actor pool's work, measured elsewhere. For each
size, ``data_pipelines.ranked.kmeans_seeds`` with the paper's 1,000 clusters x 20 seeds: mini-batch k-means
(scikit-learn) above EXACT_KMEANS_WORK rows x clusters^2, scipy's exact k-means++ and Lloyd below, forced here at the
``--exact`` sizes for the comparison. The job runs k-means on at most ``lists.kmeans_sample`` (100,000) candidates,
sampled on the cluster; the 1M row shows k-means on all of them too. Quality: the mean cosine of each candidate to
its nearest chosen seed (higher: the seeds cover the data better), and how many clusters give the full 20 seeds.
Results: ``benchmarks/results/kmeans_seeds.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_pipelines.ranked as ranked  # noqa: E402
from benchmarks.common import machine, write_results  # noqa: E402

DIM, TOPICS = 384, 2000


def embeddings(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    topics = rng.normal(size=(TOPICS, DIM)).astype(np.float32)
    return topics[rng.integers(0, TOPICS, rows)] + 0.6 * rng.normal(size=(rows, DIM)).astype(np.float32)


def coverage(data: np.ndarray, chosen: list[int]) -> float:
    """Mean cosine of a 20,000-row probe to its nearest chosen seed: a method-independent check that the seeds
    cover the data (diverse seeds leave no region far from all of them)."""
    unit = data / np.linalg.norm(data, axis=1, keepdims=True)
    seeds = unit[np.asarray(chosen)]
    probe = unit[np.random.default_rng(1).choice(len(unit), min(20_000, len(unit)), replace=False)]
    return float((probe @ seeds.T).max(axis=1).mean())


def measure(rows: int, clusters: int, per_cluster: int, exact: bool) -> dict:
    data = embeddings(rows)
    saved = ranked.EXACT_KMEANS_WORK
    ranked.EXACT_KMEANS_WORK = rows * clusters ** 2 if exact else 0
    try:
        started = time.perf_counter()
        chosen = ranked.kmeans_seeds(data, clusters, per_cluster, seed=42)
        seconds = time.perf_counter() - started
    finally:
        ranked.EXACT_KMEANS_WORK = saved
    return {"rows": rows, "method": "exact (scipy)" if exact else "mini-batch (scikit-learn)", "seconds": seconds,
            "seeds": len(chosen), "coverage_cosine": coverage(data, chosen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 100_000, 1_000_000])
    parser.add_argument("--exact", type=int, nargs="*", default=[1_000, 2_000], help="sizes also run exactly")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--per-cluster", type=int, default=20)
    args = parser.parse_args()
    runs = []
    for rows in sorted(set(args.rows) | set(args.exact)):
        for exact in ([True] if rows in args.exact else []) + ([False] if rows in args.rows else []):
            runs.append(measure(rows, args.clusters, args.per_cluster, exact))
            print(f"[bench] {runs[-1]}", flush=True)
    lines = ["# Ranked-list seed selection: k-means at scale", "",
             f"Machine: {machine()}. Synthetic 384-d embeddings ({TOPICS} topics), {args.clusters} clusters x "
             f"{args.per_cluster} seeds, seed 42. The job's default: k-means on at most 100,000 sampled candidates; "
             f"exact up to {ranked.EXACT_KMEANS_WORK:,} rows x clusters^2.", "",
             "| candidates | method | seconds | seeds | coverage (mean cosine to the nearest seed) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['rows']:,} | {r['method']} | {r['seconds']:.1f} | {r['seeds']:,} | {r['coverage_cosine']:.4f} |"
              for r in runs]
    exact = [r for r in runs if r["method"].startswith("exact")]
    if exact:  # the exact path's cost grows as rows x clusters^2: what it would take at the larger sizes
        base = max(exact, key=lambda r: r["rows"])
        lines += ["", "Exact k-means extrapolated from its largest run (rows x clusters^2): " + "; ".join(
            f"{rows:,} candidates about {base['seconds'] * rows / base['rows'] / 60:,.0f} min"
            for rows in sorted(args.rows) if rows > base["rows"]) + ". Coverage falls with the candidate count "
            "because 20,000 seeds cover a larger set; it compares methods at one size, not sizes."]
    write_results("kmeans_seeds", {"machine": machine(), "runs": runs}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"benchmark": "kmeans_seeds", "runs": runs}))


if __name__ == "__main__":
    main()
