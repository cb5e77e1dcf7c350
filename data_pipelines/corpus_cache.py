"""Validated corpora kept as Parquet, so a second run over the same files (a sweep trial, a resubmission, a
restarted driver) skips parsing and validation and reads Arrow straight back.

A cached corpus is keyed by everything that decides its rows: each file's path, size and modification time (as
``make`` decides; its ETag on object storage), the corpus kind, format, split, ``max_rows``, ``shuffle_seed``,
``on_bad_record`` and this module's format version. It lives under ``<trainer.storage_path>/corpus_cache/<key>/``
(the storage every node of a cluster reaches: a shared folder or an object-store URI) as attempt folders, each
``rows/`` (Parquet written from the cluster), ``quarantine.jsonl`` (the bad rows, if any) and ``report.json``,
written last, which lists the Parquet files and their row counts and so commits the attempt."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

from storage.paths import file_identity, remove_tree, storage_path, writable_path

CACHE_VERSION = 2  # 2: entries are attempt folders whose report is written last and lists their Parquet files
REPORT = "report.json"
ENTRY_KEYS = ("parquet", "committed_at")  # what the report adds to the corpus's own report fields


def corpus_key(kind: str, files: list[Path], fmt: str, **options) -> str:
    """A stable key of what decides the validated rows (``options``: split, max_rows, shuffle_seed, on_bad_record)."""
    stats = [file_identity(f) if f.is_file() else
             (file_identity(f)[0], *sorted((p.name, *file_identity(p)[1:]) for p in f.iterdir())) for f in files]
    identity = json.dumps({"version": CACHE_VERSION, "kind": kind, "format": fmt, "files": stats, **options},
                          sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def read_cached(folder, quarantine_path) -> tuple | None:
    """(Ray Dataset, report fields) of a whole cached corpus, or None. An entry counts only once its report (written
    last) is there and its Parquet files are the ones the report lists, with the rows it counted; anything else is
    a miss, said aloud. Its quarantine file is copied where this run keeps its own."""
    import ray

    for attempt, report in _committed(storage_path(folder)):
        problem = _mismatch(attempt / "rows", report)
        if problem:
            print(f"[raoe] corpus cache entry {attempt} ignored: {problem}", flush=True)
            continue
        if report.get("quarantine_path"):
            target = writable_path(quarantine_path or "quarantine.jsonl")
            target.write_bytes((attempt / "quarantine.jsonl").read_bytes())
            report["quarantine_path"] = str(target)
        fields = {k: v for k, v in report.items() if k not in ENTRY_KEYS}
        return ray.data.read_parquet(str(attempt / "rows")).materialize(), fields
    return None


def write_cached(folder, ds, report: dict) -> bool:
    """The validated rows as Parquet (written by the cluster's tasks, nothing collected here), then the report,
    last, in an attempt folder of its own under the entry: concurrent runs over the same files (sweep trials) never
    mix their files, and object stores need no rename. A write that fails (disk full, no permission) is a warning:
    the run goes on without the cache. Returns whether the entry was written."""
    attempt = storage_path(folder) / uuid.uuid4().hex
    try:
        ds.write_parquet(str(attempt / "rows"))
        parquet = _parquet_rows(attempt / "rows")
        if sum(parquet.values()) != report["rows_written"]:
            raise OSError(f"wrote {sum(parquet.values())} rows of {report['rows_written']}")
        if report.get("quarantine_path"):
            (attempt / "quarantine.jsonl").write_bytes(storage_path(report["quarantine_path"]).read_bytes())
        (attempt / REPORT).write_text(json.dumps({**report, "parquet": parquet, "committed_at": time.time()},
                                                 indent=2))
        return True
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail a run whose data is fine
        print(f"[raoe] warning: could not write the corpus cache entry {attempt} ({type(exc).__name__}: {exc}); "
              f"the run goes on without it", flush=True)
        remove_tree(attempt)
        return False


def _committed(entry) -> list[tuple]:
    """(attempt folder, report) of each attempt of an entry that wrote its report, the first committed first."""
    try:
        attempts = [a for a in entry.iterdir() if (a / REPORT).exists()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    reports = [(a, json.loads((a / REPORT).read_text())) for a in attempts]
    return sorted(reports, key=lambda pair: (pair[1].get("committed_at", 0), pair[0].name))


def _parquet_rows(folder) -> dict[str, int]:
    import pyarrow.parquet as pq

    rows = {}
    for file in folder.iterdir():
        if not file.is_file():  # an object store lists a folder's own marker object among its contents
            continue
        with file.open("rb") as f:
            rows[file.name] = pq.read_metadata(f).num_rows
    return rows


def _mismatch(rows_folder, report: dict) -> str | None:
    """What is wrong with an entry's Parquet files against its report, or None."""
    try:
        found = _parquet_rows(rows_folder)
    except (OSError, ValueError) as exc:
        return f"its files cannot be read ({exc})"
    listed = report.get("parquet") or {}
    if set(found) != set(listed):
        return f"{len(found)} Parquet file(s) where its report lists {len(listed)}"
    if sum(found.values()) != report.get("rows_written"):
        return f"{sum(found.values())} rows where its report counted {report.get('rows_written')}"
    return None
