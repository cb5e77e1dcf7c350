"""Corpora as Ray Datasets with a fixed schema, validated before training: ``fail`` stops with every bad
record named by file and line; ``quarantine`` sets bad rows aside in a file and counts them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote

from data_pipelines.corpus_cache import after_use, corpus_key, read_cached, write_cached
from data_pipelines.formats import FIELDS, PARSERS, SPLITTABLE, Span, detect_format, parse, read_spans
from data_pipelines.hub import hub_rows, is_hub_source
from storage.paths import files_under, storage_path, writable_path

MAX_LISTED = 20
SPAN_BYTES = 16 << 20  # text per read task: bounds a task's memory (its rows as Python objects) and spreads a file


class BadDataError(ValueError):
    """The corpus has bad records and ``on_bad_record`` is ``fail``; the message lists them."""


@dataclass
class DataReport:
    """What validation found; goes into the job's JSON line. rows_in = rows_written + rows_quarantined."""

    rows_in: int = 0
    rows_written: int = 0
    rows_quarantined: int = 0
    rows_without_gold: int = 0  # SNLI/MNLI '-' labels: no annotator consensus, not records
    quarantine_path: str | None = None
    files: list[str] = field(default_factory=list)
    format: str = ""
    cache: str | None = None  # "read": from the corpus cache, without parsing; "written": validated and cached

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def added(cls, reports: list["DataReport"]) -> "DataReport":
        """Several corpora's reports as one (data.sources): counts added, files listed, the first quarantine file."""
        counts = {k: sum(getattr(r, k) for r in reports)
                  for k in ("rows_in", "rows_written", "rows_quarantined", "rows_without_gold")}
        return cls(**counts, quarantine_path=next((r.quarantine_path for r in reports if r.quarantine_path), None),
                   files=[f for r in reports for f in r.files], format="+".join(r.format for r in reports),
                   cache="+".join(str(r.cache) for r in reports))


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # Hive's and Spark's folder for rows whose partition value is null
# Formats by the file names they read; a file whose suffix belongs to another group is refused before any work.
SUFFIX_FORMATS = {(".parquet",): ("parquet", "groups_parquet"), (".csv", ".tsv"): ("csv", "stsb_csv", "senteval_sts"),
                  (".jsonl", ".json", ".ndjson"): ("jsonl", "pairs_jsonl", "snli_jsonl", "triplets_jsonl",
                                                   "groups_jsonl")}
DATA_SUFFIXES = {suffix for suffixes in SUFFIX_FORMATS for suffix in suffixes} | {".txt"}


def corpus_files(path: str | Path, kind: str, fmt: str) -> tuple[list[Path], str]:
    """The files (or SentEval folder) behind ``path`` (local or on object storage: storage.paths) and the format
    that reads them; a format that cannot read them (data.format senteval_nli on a file, parquet on a .jsonl, ...) is
    an error naming both."""
    root = storage_path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist")
    if root.is_dir() and fmt in ("auto", "senteval_nli") and any(root.glob("s1.*")):
        return [root], "senteval_nli"
    if fmt != "auto" and fmt not in PARSERS[kind]:
        raise ValueError(f"data.format {fmt!r} does not hold {kind}; use auto or one of {sorted(PARSERS[kind])}")
    if fmt == "senteval_nli":
        raise ValueError(f"data.format senteval_nli reads a SentEval NLI folder (s1.<split>, s2.<split>, "
                         f"labels.<split>); {str(root)!r} is not one: set data.format to auto or to the file's format")
    files = [root / name for name in data_files(root)] if root.is_dir() else [root]
    if not files:
        raise FileNotFoundError(f"no data files under {root} (names starting with '.' or '_' are other tools' "
                                f"markers and metadata, and empty files hold no record)")
    resolved = detect_format(kind, files[0]) if fmt == "auto" else fmt
    for suffixes, formats in SUFFIX_FORMATS.items():
        clash = next((f for f in files if f.suffix.lower() in suffixes), None)
        if clash is not None and resolved not in formats and any(resolved in group for group in SUFFIX_FORMATS.values()):
            chosen = f"data.format {fmt!r}" if fmt != "auto" else f"the format of {files[0].name} ({resolved})"
            raise ValueError(f"{chosen} cannot read {clash.name}: {', '.join(suffixes)} files are read by "
                             f"{', '.join(formats)}{' (or data.format auto)' if fmt != 'auto' else ''}")
    return files, resolved


def data_files(root) -> list[str]:
    """The names (relative, sorted) of the data files in a folder another tool may have written, from one listing:
    Spark, Hive, pyarrow and Ray Data keep their markers and metadata in names starting with '_' or '.' (``_SUCCESS``,
    ``_committed_*``, ``_metadata``, ``.part-0.crc``, ``_temporary/``), which are never rows; empty files hold none
    either (a 0-byte "Parquet file" is not one). Where some files end in a data suffix (``.parquet``, ``.jsonl``,
    ``part-0.snappy.parquet``, ...) only those are read, so a stray README or log cannot choose the format; a folder
    of files without one (Hive's ``000000_0``) is read whole."""
    names = sorted(name for name, size, _ in files_under(root)
                   if size > 0 and not any(part[:1] in "._" for part in name.split("/")))
    with_suffix = [name for name in names if PurePosixPath(name).suffix.lower() in DATA_SUFFIXES]
    return with_suffix or names


def _sizes(root, files) -> dict[str, int]:
    """Each file's size from one listing of a folder (on object storage a stat is a request per file)."""
    if len(files) == 1 and files[0] == root:
        return {}
    return {str(root / name): size for name, size, _ in files_under(root)}


def partition_values(root, file) -> dict[str, str | None]:
    """The ``key=value`` folders between a corpus folder and one of its files (Hive / Spark ``partitionBy``), as the
    fields those folders stand for: values URL-unquoted as Spark writes them, Hive's default partition as None."""
    if file == root:
        return {}
    relative = PurePosixPath(str(file)[len(str(root).rstrip("/")) + 1:])
    values = {}
    for folder in relative.parts[:-1]:
        key, equals, value = folder.partition("=")
        if equals and key:
            values[unquote(key)] = None if value == HIVE_NULL else unquote(value)
    return values


def read_raw(kind: str, path: str | Path, fmt: str = "auto", split: str | None = None,
             listed: tuple[list[Path], str] | None = None):
    """Every raw record as a Ray Dataset row (fields + provenance + error); files are parsed in parallel.
    ``listed``: ``corpus_files``' answer when the caller has it already (a folder of many files is listed once)."""
    import ray

    if is_hub_source(path):
        return hub_rows(kind, str(path), split), [str(path)], "hub"
    files, fmt = listed or corpus_files(path, kind, fmt)
    root = storage_path(path)
    partitions = {f: json.dumps(partition_values(root, f)) for f in files}  # {} where no key=value folder
    if fmt in SPLITTABLE[kind]:  # one read task per span of about SPAN_BYTES, a large file read in parallel
        sizes = _sizes(root, files)
        items = [{"path": str(f), "start": s.start, "end": s.end, "first_line": s.first_line,
                  "partition": partitions[f]} for f in files
                 for s in read_spans(fmt, f, SPAN_BYTES, sizes.get(str(f)))]
    else:  # formats read whole (a header, a folder layout): one task per file
        items = [{"path": str(f), "start": None, "end": None, "first_line": None, "partition": partitions[f]}
                 for f in files]

    def parse_item(item: dict[str, Any]) -> list[dict[str, Any]]:
        span = None if item["start"] is None else Span(item["start"], item["end"], item["first_line"])
        return list(parse(kind, fmt, storage_path(item["path"]), split, span, json.loads(item["partition"])))

    ds = ray.data.from_items(items, override_num_blocks=len(items))
    return ds.flat_map(parse_item), [str(f) for f in files], fmt


def load_corpus(
    kind: str,
    path: str | Path,
    *,
    fmt: str = "auto",
    split: str | None = None,
    max_rows: int | None = None,
    shuffle_seed: int | None = None,
    on_bad_record: Literal["fail", "quarantine"] = "fail",
    quarantine_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    cache_max_gb: float | None = None,
):
    """(validated Ray Dataset of the kind's fields, DataReport). Raises BadDataError in ``fail`` mode. With
    ``cache_dir``, a corpus validated before from unchanged files is read back from Parquet (corpus_cache), and the
    cache is kept under ``cache_max_gb`` (checked when an entry is written)."""
    cached_folder = listed = None
    if cache_dir is not None and not is_hub_source(path):
        listed = files, resolved = corpus_files(path, kind, fmt)
        cached_folder = storage_path(cache_dir) / corpus_key(kind, files, resolved, split=split, max_rows=max_rows,
                                                     shuffle_seed=shuffle_seed, on_bad_record=on_bad_record)
        cached = read_cached(cached_folder, quarantine_path)
        if cached is not None:
            after_use(cached_folder, cache_max_gb, wrote=False)
            print(f"[raoe] validated corpus from the cache {cached_folder} (files unchanged)", flush=True)
            return cached[0], DataReport(**{**cached[1], "cache": "read"})
    good, report = _validated(kind, path, fmt, split, max_rows, shuffle_seed, on_bad_record, quarantine_path, listed)
    if cached_folder is not None and report.rows_written and write_cached(cached_folder, good,
                                                                          {**report.as_dict(), "cache": None}):
        report.cache = "written"
        after_use(cached_folder, cache_max_gb, wrote=True)
    return good, report


def _validated(kind, path, fmt, split, max_rows, shuffle_seed, on_bad_record, quarantine_path, listed):
    raw, files, fmt = read_raw(kind, path, fmt, split, listed)
    # Ray Data hands on blocks as their tasks finish; data.max_rows must keep the same rows every run (the first in
    # file order, or of a seeded shuffle of them): blocks in order while the subset is taken. The options belong to
    # this dataset's own copy of Ray Data's context, handed on to what is built on it: unordered again after.
    unordered = raw.context.execution_options.preserve_order
    raw.context.execution_options.preserve_order = unordered or max_rows is not None
    if shuffle_seed is not None:  # corpora are often sorted (STS-B by genre): shuffle so max_rows is a fair sample
        raw = raw.random_shuffle(seed=shuffle_seed)
    if max_rows is not None:
        raw = raw.limit(max_rows)
    raw = raw.materialize()  # parse once; both the good and the bad rows are read from here
    raw.context.execution_options.preserve_order = unordered
    report = DataReport(files=files, format=fmt)
    counts = raw.map_batches(_count_records, batch_format="pyarrow", batch_size=None).take_all()  # a row a block
    report.rows_without_gold = sum(int(c["skipped"]) for c in counts)
    report.rows_in = sum(int(c["records"]) for c in counts)
    report.rows_quarantined = bad = sum(int(c["bad"]) for c in counts)
    report.rows_written = report.rows_in - bad
    if bad and on_bad_record == "fail":
        listed = "\n  ".join(f"{r['source']}:{r['line']}: {r['error']}" for r in _first_bad(raw))
        more = f"\n  ... and {bad - MAX_LISTED} more" if bad > MAX_LISTED else ""
        raise BadDataError(
            f"{bad} bad record(s) in {kind} data (set data.on_bad_record=quarantine to set them aside):\n  "
            f"{listed}{more}"
        )
    if bad:
        report.quarantine_path = _write_quarantine(raw, quarantine_path or "quarantine.jsonl")
    # Materialised into the object store: a consumer (a Ray Train worker group holding most CPUs, a Tune trial)
    # then streams blocks without needing a CPU for read/filter tasks, which could otherwise wait forever.
    good = _where(raw, _is_good).select_columns(list(FIELDS[kind])).materialize()
    return good, report


# Validation passes as Arrow compute over whole batches (a Python predicate per row took 1-6 s a pass per million).
def _where(ds, predicate):
    return ds.map_batches(lambda table: table.filter(predicate(table)), batch_format="pyarrow")


def _is_bad(table):
    import pyarrow.compute as pc

    return pc.and_(pc.invert(table["skipped"]), pc.is_valid(table["error"]))


def _is_good(table):
    import pyarrow.compute as pc

    return pc.and_(pc.invert(table["skipped"]), pc.is_null(table["error"]))


def count_where(ds, predicate) -> int:
    """Rows of ``ds`` where ``predicate`` (an Arrow table -> boolean array) holds, batch by batch."""
    return counts_where(ds, n=predicate)["n"]


def counts_where(ds, **predicates) -> dict[str, int]:
    """In one pass over ``ds``: its rows (``rows``) and, for each named predicate (an Arrow table -> boolean array),
    the rows where it holds. One pass, not one per count: at 100M rows each pass reads the whole corpus."""
    import pyarrow as pa

    def count(table):
        return pa.table({"rows": [table.num_rows],
                         **{name: [len(table.filter(holds(table)))] for name, holds in predicates.items()}})

    counted = ds.map_batches(count, batch_format="pyarrow").take_all()  # a row per batch: no aggregation shuffle
    return {name: sum(int(row[name]) for row in counted) for name in ("rows", *predicates)}


def _count_records(table):
    """Per batch: rows that are not records (SNLI's '-' gold labels), rows that are (good or bad), and bad rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    skipped = int(pc.sum(table["skipped"].cast(pa.int64())).as_py() or 0)
    bad = int(pc.sum(_is_bad(table).cast(pa.int64())).as_py() or 0)
    return pa.table({"skipped": [skipped], "records": [table.num_rows - skipped], "bad": [bad]})


def _first_bad(raw) -> list[dict]:
    """The first MAX_LISTED bad rows in file order, for the error message: each task sends at most that many (their
    messages cut to 300 characters), so the driver holds a bounded list however many rows are bad."""
    rows = raw.map_batches(_first_bad_of_batch, batch_format="pyarrow", batch_size=None).take_all()
    return sorted(rows, key=lambda r: (r["source"], r["line"]))[:MAX_LISTED]


def _first_bad_of_batch(table):
    import pyarrow as pa
    import pyarrow.compute as pc

    bad = table.filter(_is_bad(table)).select(["source", "line", "error"])
    first = bad.sort_by([("source", "ascending"), ("line", "ascending")]).slice(0, MAX_LISTED)
    return first.set_column(2, "error", pc.utf8_slice_codeunits(first["error"].cast(pa.string()), 0, 300))


def _write_quarantine(raw, path) -> str:
    """The bad rows as JSON lines {source, line, reason, raw}, streamed batch by batch from the tasks that hold them
    into one file (local or on object storage): the driver holds one batch at a time, never all of them."""
    target = writable_path(path)
    with target.open("w", encoding="utf-8") as out:
        for batch in _where(raw, _is_bad).select_columns(["source", "line", "error", "raw"]).iter_batches(
                batch_format="pyarrow", batch_size=4096):
            for r in batch.to_pylist():
                out.write(json.dumps({"source": r["source"], "line": r["line"], "reason": r["error"],
                                      "raw": r["raw"]}) + "\n")
    return str(target)


def load_configured(kind: str, data_cfg, quarantine_path: str | Path):
    """``load_corpus`` with a job's ``data.*`` keys (train, format, split, max_rows, shuffle_seed, on_bad_record)."""
    return load_corpus(kind, data_cfg.train, fmt=data_cfg.format, split=data_cfg.split, max_rows=data_cfg.max_rows,
                       shuffle_seed=data_cfg.shuffle_seed, on_bad_record=data_cfg.on_bad_record,
                       quarantine_path=quarantine_path)
