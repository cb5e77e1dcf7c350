"""RSE data preparation at scale: one large relation (same-sent, every row a distinct sentence) prepared by
data_pipelines.relations.prepare_triples_ds as one Ray task for the whole relation (the old design: its memory grows
with the relation) against shares of at most ``--rows-per-task`` triples (one task each), in the same run. Sampled
every 0.1 s: the peak heap (anonymous memory) of any one Ray worker process, and the preparation's wall time.

  python benchmarks/rse_prepare.py [--rows 4000000] [--rows-per-task 250000]

A benchmark, not a test: a few minutes here.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402


def _peak_worker_heap(peak: dict, stop: threading.Event) -> None:
    """Anonymous memory (heap: /proc/PID/smaps_rollup) of each Ray worker: not RSS or USS, which count the
    object-store pages a worker has written or read (shared memory, often mapped by that worker alone)."""
    import psutil

    while not stop.is_set():
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if " ".join(proc.info["cmdline"] or []).startswith("ray::"):
                    rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
                    kb = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Anonymous:"))
                    peak["heap"] = max(peak["heap"], kb << 10)
            except (OSError, StopIteration, psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        stop.wait(0.1)


def _sampled(work) -> tuple[object, float, int]:
    """``work()``'s result, seconds, and the peak heap of any Ray worker meanwhile (MB)."""
    peak, stop = {"heap": 0}, threading.Event()
    sampler = threading.Thread(target=_peak_worker_heap, args=(peak, stop), daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return result, round(seconds, 1), peak["heap"] >> 20


def routing_only(ds, partitions: int) -> dict:
    """Ray Data's groupby alone, as prepare_triples_ds routes the shares (each group whole to one task)."""
    import numpy as np

    numbered = ds.map_batches(lambda t: t.append_column("_share", [np.arange(t.num_rows) % partitions]),
                              batch_format="pyarrow")
    grouped = numbered.groupby("_share", num_partitions=partitions).map_groups(lambda t: t.slice(0, 1),
                                                                               batch_format="pyarrow")
    _, seconds, heap = _sampled(grouped.materialize)
    return {"partitions": partitions, "seconds": seconds, "peak_task_heap_mb": heap}


def prepare(ds, rows_per_task: int) -> dict:
    from data_pipelines.relations import prepare_triples_ds
    from jobconfig.schema import RelationalDataConfig

    cfg = RelationalDataConfig(train="unused", heldout=200)
    data, seconds, heap = _sampled(lambda: prepare_triples_ds(ds, cfg, seed=0, rows_per_task=rows_per_task))
    return {"rows_per_task": rows_per_task, "seconds": seconds, "peak_task_heap_mb": heap,
            "training_triples": data.counts, "heldout": len(data.heldout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000, help="same-sent triples of the one relation")
    parser.add_argument("--rows-per-task", type=int, default=250_000, help="the shares' size")
    args = parser.parse_args()

    import numpy as np
    import pyarrow as pa
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    words = np.array([f"w{i}" for i in range(5000)])
    rng = np.random.default_rng(0)
    blocks = []
    for start in range(0, args.rows, 100_000):
        n = min(100_000, args.rows - start)
        text = pa.array([f"s{start + i} " + " ".join(ws) for i, ws in enumerate(rng.choice(words, (n, 8)))])
        blocks.append(pa.table({"head": text, "tail": text, "relation": pa.array(["same-sent"] * n),
                                "negative": pa.nulls(n, pa.string())}))
    ds = ray.data.from_arrow(blocks).materialize()
    runs = [prepare(ds, rows) for rows in (args.rows, args.rows_per_task)]
    routing = routing_only(ds, -(-args.rows // args.rows_per_task))
    ray.shutdown()

    payload = {"machine": machine(), "rows": args.rows, "runs": runs, "routing_only": routing}
    lines = ["# RSE data preparation: one task per relation against shares", "",
             f"One same-sent relation of {args.rows:,} distinct sentences (~70 characters), held-out 200, "
             f"`prepare_triples_ds` on a local Ray with 2 CPUs; peak heap (anonymous memory, without the object-store "
             f"pages a worker maps) of any one Ray worker process, sampled every 0.1 s. The last row is Ray Data's "
             f"groupby alone on the same rows (the hash shuffle that routes each share whole to its task), for scale.", "",
             f"`python benchmarks/rse_prepare.py --rows {args.rows} --rows-per-task {args.rows_per_task}`", "",
             "| triples per task at most | tasks | seconds | peak task heap (MB) |", "|---|---|---|---|"]
    for run in runs:
        tasks = -(-args.rows // run["rows_per_task"])
        lines.append(f"| {run['rows_per_task']:,} | {tasks} | {run['seconds']} | {run['peak_task_heap_mb']:,} |")
    lines.append(f"| (Ray Data's groupby alone, {routing['partitions']} groups) | | {routing['seconds']} | "
                 f"{routing['peak_task_heap_mb']:,} |")
    print(write_results("rse_prepare", payload, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
