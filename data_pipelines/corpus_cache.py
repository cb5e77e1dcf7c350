"""Validated corpora kept as Parquet, so a second run over the same files (a sweep trial, a resubmission, a
restarted driver) skips parsing and validation and reads Arrow straight back.

A cached corpus is keyed by everything that decides its rows: each file's path, size and modification time (as
``make`` decides; its ETag on object storage), the corpus kind, format, split, ``max_rows``, ``shuffle_seed``,
``on_bad_record`` and this module's format version. It lives under ``<trainer.storage_path>/corpus_cache/<key>/``
(the storage every node of a cluster reaches: a shared folder or an object-store URI) as attempt folders, each
``rows/`` (Parquet written from the cluster), ``quarantine.jsonl`` (the bad rows, if any) and ``report.json``,
written last, which lists the Parquet files and their row counts and so commits the attempt.

Housekeeping (``after_use``): an entry records when it was last used; after a write (the only time the cache grows),
attempts never committed (a killed writer) are removed once a day old, and with ``data.cache_max_gb`` the least
recently used entries until the cache fits. A read lists nothing beyond its own entry. None of it can fail a run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from storage import in_use
from storage.paths import (
    ABANDONED_AFTER_S,
    copy_file,
    file_identity,
    files_under,
    remove_tree,
    storage_path,
    writable_path,
    write_whole,
)

CACHE_VERSION = 4  # 2: attempt folders committed by their report; 3: keys hold content edges and the readers' code;
# 4: keys from one stat or listing (ctime and inode, no content), reports hold each Parquet file's size
REPORT = "report.json"
LAST_USED = "last_used.json"  # in an entry's folder: when a run last read or wrote it (least recently used goes first)
ENTRY_KEYS = ("parquet", "sizes", "committed_at")
# Blocks joined into Parquet files of at least this much: a warm start reads files, not one per block (200 blocks of a
# 200-shard corpus were 200 files and 810 requests of Ray's reader; 100M pairs are ~360 files, still read in parallel)
CACHE_FILE_BYTES = 64 << 20  # what the report adds to the corpus's own report fields


def corpus_key(kind: str, files: list[Path], fmt: str, **options) -> str:
    """A stable key of what decides the validated rows (``options``: split, max_rows, shuffle_seed, on_bad_record):
    each file's identity (storage.paths.file_identity: on a file system size, mtime, ctime and inode from one stat;
    on object storage the ETag from the listing that found the file, no request per file; nothing read of any
    content) and the code of the readers that validated it."""
    stats = [(str(f), *sorted((p.name, *file_identity(p)[1:]) for p in f.iterdir())) if fmt == "senteval_nli"
             else file_identity(f) for f in files]
    identity = json.dumps({"version": CACHE_VERSION, "readers": _readers_code(), "kind": kind, "format": fmt,
                           "files": stats, **options}, sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def _readers_code() -> str:
    """A hash of the modules that parse and validate a corpus: a change to them is a new key, not a stale entry.
    (Read as files beside this one: readers imports this module.)"""
    digest = hashlib.sha1()
    for name in ("formats.py", "readers.py", "records.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:12]


def read_cached(folder, quarantine_path) -> tuple | None:
    """(Ray Dataset, report fields) of a whole cached corpus, or None. An entry counts only once its report (written
    last) is there and its Parquet files are the ones the report lists, with the rows it counted; anything else is
    a miss, said aloud. Its quarantine file is copied where this run keeps its own. The entry is marked in use
    from before the read to its end (storage.in_use), so that no other run's ``tidy`` evicts it meanwhile."""
    committed = _committed(storage_path(folder))
    if not committed:
        return None
    with in_use.held(str(storage_path(folder) / LAST_USED)):
        return _first_whole(committed, quarantine_path)


def _first_whole(committed: list[tuple], quarantine_path) -> tuple | None:
    """The first committed attempt whose Parquet files are what its report lists, read."""
    for attempt, report in committed:
        problem = _mismatch(attempt / "rows", report)
        if problem:
            print(f"[raoe] corpus cache entry {attempt} ignored: {problem}", flush=True)
            continue
        if report.get("quarantine_path"):
            target = writable_path(quarantine_path or "quarantine.jsonl")
            copy_file(attempt / "quarantine.jsonl", target)  # streamed: a quarantine can be larger than memory
            report["quarantine_path"] = str(target)
        fields = {k: v for k, v in report.items() if k not in ENTRY_KEYS}
        return _read_rows(attempt / "rows"), fields
    return None


def _read_rows(rows_folder):
    """The entry's Parquet files as one materialised Dataset, read by Ray Data's V1 Parquet reader. Ray 2.60's default
    reader (DataSourceV2) starts a pool of FooterReader actors on every read to index the files' row groups: 2-3 s of
    each warm start of a job here (benchmarks/corpus_cache_read.py), for footers this module has already read on the
    driver to check the entry (``_mismatch``). No partitioning: a ``key=value`` folder in the storage path is not a
    column of the corpus."""
    import ray

    with parquet_reader(v2=False):
        planned = ray.data.read_parquet(str(rows_folder), partitioning=None)
    return planned.materialize()


@contextlib.contextmanager
def parquet_reader(v2: bool):
    """Ray Data's Parquet reader for the ``read_parquet`` calls inside: DataSourceV2 or V1
    (``DataContext.use_datasource_v2``, read when a read is planned), the setting before restored after."""
    import ray

    context = ray.data.DataContext.get_current()
    v2_before, context.use_datasource_v2 = context.use_datasource_v2, v2
    try:
        yield
    finally:
        context.use_datasource_v2 = v2_before


def write_cached(folder, ds, report: dict) -> bool:
    """The validated rows as Parquet (written by the cluster's tasks, nothing collected here), then the report,
    last, in an attempt folder of its own under the entry: concurrent runs over the same files (sweep trials) never
    mix their files, and object stores need no rename. A write that fails (disk full, no permission) is a warning:
    the run goes on without the cache. Returns whether the entry was written."""
    attempt = storage_path(folder) / uuid.uuid4().hex
    try:
        ds.write_parquet(str(attempt / "rows"), min_bytes_per_file=CACHE_FILE_BYTES)
        parquet = _parquet_rows(attempt / "rows")
        if sum(parquet.values()) != report["rows_written"]:
            raise OSError(f"wrote {sum(parquet.values())} rows of {report['rows_written']}")
        sizes = _parquet_sizes(attempt / "rows")
        if report.get("quarantine_path"):
            copy_file(storage_path(report["quarantine_path"]), attempt / "quarantine.jsonl")
        # Whole or not at all: a report cut short by a killed writer would be read as committed.
        write_whole(attempt / REPORT, json.dumps({**report, "parquet": parquet, "sizes": sizes,
                                                  "committed_at": time.time()}, indent=2))
        return True
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail a run whose data is fine
        print(f"[raoe] warning: could not write the corpus cache entry {attempt} ({type(exc).__name__}: {exc}); "
              f"the run goes on without it", flush=True)
        remove_tree(attempt)
        return False


def after_use(entry, max_gb: float | None, wrote: bool) -> None:
    """Record that ``entry`` was just used; after a write, also remove the cache's killed attempts a day old and,
    with ``max_gb``, the least recently used entries (never this one) until the cache fits (one listing of the whole
    cache: on object storage that is a request per thousand files, so a read, which adds nothing, skips it). A
    failure is a warning."""
    entry = storage_path(entry)
    try:
        write_whole(entry / LAST_USED, json.dumps({"at": time.time()}))
        removed = tidy(entry.parent, max_gb, keep=entry.name) if wrote else []
        if removed:
            print(f"[raoe] corpus cache {entry.parent}: removed {', '.join(removed)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a run whose data is fine
        print(f"[raoe] warning: corpus cache housekeeping in {entry.parent} failed ({type(exc).__name__}: {exc})",
              flush=True)


@dataclass
class _Entry:
    """What one listing of the cache says of an entry."""

    bytes: int = 0
    newest: float = 0.0  # its newest file's modification time
    used: float | None = None  # when LAST_USED was written
    attempts: dict[str, list[tuple[str, int, float]]] = field(default_factory=dict)  # name -> (file, size, mtime)

    @property
    def last_use(self) -> float:
        return self.used if self.used is not None else self.newest


def tidy(root, max_gb: float | None, keep: str | None = None, now: float | None = None) -> list[str]:
    """Remove attempts never committed and older than ABANDONED_AFTER_S, then (``max_gb``) whole entries by least
    recent use until the rest fit, never one used within in_use.GRACE_S (another run may be reading it); returns what
    was removed. One listing of the cache gives sizes and ages."""
    root, now = storage_path(root), time.time() if now is None else now
    entries: dict[str, _Entry] = {}
    for name, size, mtime in files_under(root):
        key, _, inside = name.partition("/")
        if not inside:
            continue  # a file at the cache's top is no entry
        entry = entries.setdefault(key, _Entry())
        entry.bytes += size
        entry.newest = max(entry.newest, mtime)
        if inside == LAST_USED:
            entry.used = mtime
        else:
            attempt, _, file = inside.partition("/")
            entry.attempts.setdefault(attempt, []).append((file, size, mtime))
    removed = []
    for key, entry in entries.items():
        for attempt, files in entry.attempts.items():
            age = now - max(mtime for _, _, mtime in files)
            if age > ABANDONED_AFTER_S and all(file != REPORT for file, _, _ in files):
                remove_tree(root / key / attempt)
                entry.bytes -= sum(size for _, size, _ in files)
                removed.append(f"{key}/{attempt} (never committed, {age / 3600:.0f} h old)")
    total = sum(entry.bytes for entry in entries.values())
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].last_use):
        if max_gb is None or total <= max_gb * 1e9:
            break
        if key != keep and now - entry.last_use >= in_use.GRACE_S:
            remove_tree(root / key)
            total -= entry.bytes
            removed.append(f"{key} ({entry.bytes / 1e9:.3f} GB, least recently used; data.cache_max_gb={max_gb})")
    return removed


def _committed(entry, now: float | None = None) -> list[tuple]:
    """(attempt folder, report) of each attempt of an entry that wrote a readable report, the first committed first.
    A report that is not JSON (cut short by a writer killed before reports were written whole) commits nothing:
    the attempt is a miss, said aloud, and is removed once ABANDONED_AFTER_S old."""
    attempts = [entry / name.split("/")[0] for name, _, _ in files_under(entry) if name.endswith(f"/{REPORT}")
                and name.count("/") == 1]  # one listing of the entry, not a request per attempt
    reports = []
    for attempt in attempts:
        try:
            report = json.loads((attempt / REPORT).read_text())
            if not isinstance(report, dict):
                raise ValueError(f"a JSON {type(report).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            age = (time.time() if now is None else now) - (attempt / REPORT).stat().st_mtime
            print(f"[raoe] corpus cache entry {attempt} ignored: its report cannot be read ({exc})", flush=True)
            if age > ABANDONED_AFTER_S:
                remove_tree(attempt)
            continue
        reports.append((attempt, report))
    return sorted(reports, key=lambda pair: (pair[1].get("committed_at", 0), pair[0].name))


def _parquet_rows(folder) -> dict[str, int]:
    import pyarrow.parquet as pq

    rows = {}
    for name in _parquet_sizes(folder):  # one listing (an object store's folder marker is no file of it)
        with (folder / name).open("rb") as f:
            rows[name] = pq.read_metadata(f).num_rows
    return rows


def _parquet_sizes(folder) -> dict[str, int]:
    """Each Parquet file's size, from one listing."""
    return {name: size for name, size, _ in files_under(folder) if "/" not in name}


def _mismatch(rows_folder, report: dict) -> str | None:
    """What is wrong with an entry's Parquet files against its report, or None: one listing, each file there with
    the size the report gives (no footer read: a cache of 10,000 files is one request, not 10,000)."""
    try:
        found = _parquet_sizes(rows_folder)
    except OSError as exc:
        return f"its files cannot be listed ({exc})"
    listed = report.get("sizes") or {}
    if set(found) != set(listed):
        return f"{len(found)} Parquet file(s) where its report lists {len(listed)}"
    wrong = next((name for name, size in listed.items() if found[name] != size), None)
    if wrong is not None:
        return f"{wrong} holds {found[wrong]} bytes where its report says {listed[wrong]}"
    if sum((report.get("parquet") or {}).values()) != report.get("rows_written"):
        return f"its report counts {sum(report['parquet'].values())} rows of {report.get('rows_written')}"
    return None
