"""Validated corpora kept as Parquet, so a second run over the same files (a sweep trial, a resubmission, a
restarted driver) skips parsing and validation and reads Arrow straight back.

A cached corpus is keyed by everything that decides its rows: each file's path, size and modification time (as
``make`` decides; its ETag on object storage), the corpus kind, format, split, ``max_rows``, ``shuffle_seed``,
``on_bad_record`` and this module's format version. It lives under ``<trainer.storage_path>/corpus_cache/<key>/``
(the storage every node of a cluster reaches): ``rows/`` (Parquet written from the cluster), ``quarantine.jsonl``
(the bad rows, if any) and ``report.json``. Each write goes to a folder of its own, renamed into place when
whole."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

from runtime.storage import file_identity

CACHE_VERSION = 1
REPORT = "report.json"


def corpus_key(kind: str, files: list[Path], fmt: str, **options) -> str:
    """A stable key of what decides the validated rows (``options``: split, max_rows, shuffle_seed, on_bad_record)."""
    stats = [file_identity(f) if f.is_file() else
             (file_identity(f)[0], *sorted((p.name, *file_identity(p)[1:]) for p in f.iterdir())) for f in files]
    identity = json.dumps({"version": CACHE_VERSION, "kind": kind, "format": fmt, "files": stats, **options},
                          sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def read_cached(folder: Path, quarantine_path: Path | None):
    """(Ray Dataset, report fields) of a whole cached corpus, or None. Its quarantine file is copied where this run
    keeps its own."""
    import ray

    if not (folder / REPORT).exists():
        return None
    report = json.loads((folder / REPORT).read_text())
    if report.get("quarantine_path"):
        target = Path(quarantine_path or "quarantine.jsonl")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "quarantine.jsonl", target)
        report["quarantine_path"] = str(target.resolve())
    return ray.data.read_parquet(str(folder / "rows")).materialize(), report


def write_cached(folder: Path, ds, report: dict) -> None:
    """The validated rows as Parquet (written by the cluster's tasks, nothing collected here) and the report, in a
    folder of their own renamed into place when whole: concurrent runs over the same files (sweep trials) never
    mix their files, and the first to finish is kept."""
    staging = folder.with_name(f"{folder.name}.{uuid.uuid4().hex}.partial")
    staging.mkdir(parents=True)
    try:
        ds.write_parquet(str(staging / "rows"))
        if report.get("quarantine_path"):
            shutil.copyfile(report["quarantine_path"], staging / "quarantine.jsonl")
        (staging / REPORT).write_text(json.dumps(report, indent=2))
        if folder.exists() and not (folder / REPORT).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a whole entry always has its report: this one is not
        staging.rename(folder)
    except OSError:
        if not (folder / REPORT).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; else another run's entry is kept
