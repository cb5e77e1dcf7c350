"""A warm job's corpus read: ``load_corpus`` from an unchanged cached corpus (data.cache, on by default), with the
cache's Parquet files read by Ray Data's default reader (DataSourceV2 in Ray 2.60, which starts FooterReader actors on
every read: what raoe did before) and by its V1 reader (what ``data_pipelines.corpus_cache`` does now), in turn on one
local Ray, after a round that warms both.

  python benchmarks/corpus_cache_read.py [--rounds 6] [--data configs/tiny/data/nli_pairs.jsonl --kind pairs]

Results: benchmarks/results/corpus_cache_read.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

READERS = ("default reader, DataSourceV2 (before)", "V1 reader (now)")


def measure(data: Path, kind: str, rounds: int) -> dict[str, list[float]]:
    import ray

    from data_pipelines import corpus_cache
    from data_pipelines.readers import load_corpus
    from runtime.local_ray import ray_session

    def default_reader(folder):  # what read_cached did before, with Ray 2.60's default whatever the environment says
        with corpus_cache.parquet_reader(v2=True):
            planned = ray.data.read_parquet(str(folder))
        return planned.materialize()

    original = corpus_cache._read_rows
    readers = {READERS[0]: default_reader, READERS[1]: original}
    seconds: dict[str, list[float]] = {name: [] for name in READERS}
    with tempfile.TemporaryDirectory() as cache, ray_session(num_cpus=2):
        ray.data.DataContext.get_current().enable_progress_bars = False
        _, report = load_corpus(kind, str(data), cache_dir=cache)  # validates and writes the entry
        try:
            for rnd in range(rounds + 1):
                for name in READERS if rnd % 2 == 0 else READERS[::-1]:
                    corpus_cache._read_rows = readers[name]
                    start = time.perf_counter()
                    ds, again = load_corpus(kind, str(data), cache_dir=cache)
                    rows = ds.count()
                    elapsed = time.perf_counter() - start
                    assert again.cache == "read" and rows == report.rows_written, (again.cache, rows)
                    if rnd:  # round 0 warms both
                        seconds[name].append(elapsed)
        finally:
            corpus_cache._read_rows = original
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--data", type=Path, default=ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl")
    parser.add_argument("--kind", default="pairs")
    args = parser.parse_args()

    import ray

    from benchmarks.common import machine, write_results

    seconds = measure(args.data, args.kind, args.rounds)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    rows = "\n".join(f"| {name} | {medians[name]:.3f} | {', '.join(f'{s:.3f}' for s in seconds[name])} |"
                     for name in READERS)
    resolved = args.data.resolve()
    data = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else args.data
    markdown = (f"# A warm job's corpus read from the cache\n\n`load_corpus` of an unchanged cached corpus ({args.kind}, "
                f"`{data}`), counted; "
                f"the two readers in turn on one local Ray {ray.__version__} (2 CPUs), {args.rounds} rounds after one that "
                f"warms both. "
                f"Machine: {machine()}.\n\n| cache files read by | median s | runs |\n|---|---|---|\n{rows}\n\n"
                f"The V1 reader saves {medians[READERS[0]] - medians[READERS[1]]:.2f} s a read "
                f"({medians[READERS[0]] / medians[READERS[1]]:.1f}x).\n")
    payload = {"machine": machine(), "ray": ray.__version__, "data": str(data), "kind": args.kind, "rounds": args.rounds,
               "seconds": seconds, "median_s": medians}
    print(markdown)
    print(f"wrote {write_results('corpus_cache_read', payload, markdown)}")


if __name__ == "__main__":
    main()
