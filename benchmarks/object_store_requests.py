"""Object-store requests and bytes of reading a corpus of many shards, cold (validated and cached) and warm (read from
the corpus cache), as a job's driver and its Ray Data tasks send them (issue 71; the job-level timings and the
driver's memory are cluster_storage.py's).

  python benchmarks/object_store_requests.py [--shards 2000] [--rows-per-shard 50] [--label after]

An S3 server (moto's, on 127.0.0.1) behind a counting WSGI layer records every request any process sends: its
method, its object and the bytes it returns. The corpus is ``--shards`` JSON-lines files of NLI pairs; each run is
``load_corpus(..., cache_dir=s3://.../corpus_cache)`` on an embedded local Ray (2 CPUs) and a count of its rows.
Results: ``benchmarks/results/object_store_requests.{json,md}``, one entry per ``--label``: run it in a checkout of
an older commit (copy this file there) with ``--label before`` to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results"  # where this file is: a copy in an older checkout writes here


class CountingS3:
    """moto's S3 application served on 127.0.0.1 through a layer that records (method, path, bytes returned)."""

    def __enter__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app, self.seen, self.lock = DomainDispatcherApplication(create_backend_app), [], threading.Lock()

        def counting(environ, start_response):
            body = list(app(environ, start_response))
            with self.lock:
                self.seen.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], sum(len(b) for b in body)))
            return body

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.server = make_server("127.0.0.1", port, counting, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.shutdown()

    def taken(self) -> list[tuple[str, str, int]]:
        with self.lock:
            seen, self.seen = self.seen, []
        return seen


def _summary(seen, shard_prefix: str, corpus_bytes: int) -> dict:
    methods = collections.Counter(method for method, _, _ in seen)
    on_shards = [(m, b) for m, path, b in seen if path.startswith(shard_prefix)]
    shard_get_bytes = sum(b for m, b in on_shards if m == "GET")
    return {"requests": len(seen), "by_method": dict(sorted(methods.items())),
            "requests_on_shards": len(on_shards), "listings": sum(1 for m, p, _ in seen if m == "GET" and
                                                                   p.strip("/").count("/") == 0),
            "get_bytes": sum(b for m, _, b in seen if m == "GET"), "shard_get_bytes": shard_get_bytes,
            "shard_bytes_ratio": round(shard_get_bytes / corpus_bytes, 3)}


def measure(shards: int, rows_per_shard: int) -> dict:
    import os

    import boto3

    with CountingS3() as s3:
        os.environ.update(AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        os.environ.pop("AWS_PROFILE", None)
        from data_pipelines.readers import load_corpus
        from runtime.local_ray import start_ray

        client = boto3.client("s3", endpoint_url=s3.endpoint)
        client.create_bucket(Bucket="bench")
        corpus_bytes = 0
        for shard in range(shards):
            body = "".join(json.dumps({"text1": f"premise {shard} {i}", "text2": f"hypothesis {i}", "label": i % 3})
                           + "\n" for i in range(rows_per_shard)).encode()
            client.put_object(Bucket="bench", Key=f"corpus/part-{shard:05d}.jsonl", Body=body)
            corpus_bytes += len(body)
        start_ray(num_cpus=2)
        s3.taken()
        runs = []
        for run in ("cold", "warm"):
            started = time.perf_counter()
            ds, report = load_corpus("pairs", "s3://bench/corpus", cache_dir="s3://bench/runs/corpus_cache")
            rows = ds.count()
            seconds = time.perf_counter() - started
            runs.append({"run": run, "seconds": round(seconds, 1), "rows": rows, "cache": report.cache,
                         **_summary(s3.taken(), "/bench/corpus/", corpus_bytes)})
            print(f"[bench] {runs[-1]}", flush=True)
        return {"shards": shards, "rows_per_shard": rows_per_shard, "corpus_bytes": corpus_bytes, "runs": runs}


def render(results: dict) -> str:
    lines = ["# Object-store requests of a corpus read over many shards", "",
             "`python benchmarks/object_store_requests.py`: JSON-lines shards on moto's S3 server on 127.0.0.1 behind a "
             "counting layer (every process's requests); `load_corpus` with the corpus cache on the same store, on an "
             "embedded local Ray with 2 CPUs. Cold: validated and cached; warm: read from the cache. `before`: the "
             "same file run in a checkout of main before issue 71's change.", "",
             "| code | shards | run | requests | GET / HEAD / PUT / other | on shards | listings | bytes of shards read "
             "/ corpus | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for label, result in results.items():
        for run in result["runs"]:
            m = run["by_method"]
            other = run["requests"] - sum(m.get(k, 0) for k in ("GET", "HEAD", "PUT"))
            lines.append(f"| {label} | {result['shards']:,} | {run['run']} | {run['requests']:,} | {m.get('GET', 0)} / "
                         f"{m.get('HEAD', 0)} / {m.get('PUT', 0)} / {other} | {run['requests_on_shards']:,} | "
                         f"{run['listings']} | {run['shard_bytes_ratio']}x | {run['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--rows-per-shard", type=int, default=50)
    parser.add_argument("--label", default="after", help="the entry this run records (others are kept)")
    args = parser.parse_args()
    path = RESULTS / "object_store_requests.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.label] = measure(args.shards, args.rows_per_shard)
    path.write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "object_store_requests.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
