"""Line-level parsers for every corpus format. Each yields one dict per raw record with its source and
line number, and either the record's fields or an ``error``; the Ray layer (readers.py) runs them."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from data_pipelines.records import (
    NO_LABEL,
    RecordError,
    group_record,
    normalise_label,
    pair_record,
    sentence_record,
    sts_record,
    triple_record,
    triplet_record,
)
from storage.paths import open_head, read_range

Row = dict[str, Any]
CORPUS_KINDS = ("pairs", "sts", "sentences", "lists", "triples", "triplets", "groups")
PARQUET_FORMATS = ("parquet", "groups_parquet")
# Formats of one JSON object or Parquet row per record: the only ones a key=value folder layout adds fields to.
RECORD_FORMATS = ("parquet", "groups_parquet", "jsonl", "pairs_jsonl", "snli_jsonl", "triplets_jsonl", "groups_jsonl")


@dataclass(frozen=True)
class Span:
    """A run of whole lines of one file: bytes [start, end), the first of them line ``first_line`` (1-based). A
    large file is read as many spans in parallel, each naming its bad rows by the file's own line numbers."""

    start: int
    end: int
    first_line: int


def file_spans(path: Path, target_bytes: int, chunk_bytes: int = 8 << 20, size: int | None = None) -> list[Span]:
    """``path`` cut at line ends into spans of about ``target_bytes``: one pass counting newlines, ``chunk_bytes`` at
    a time (about a second a GB). ``size``: the file's, where a listing gave it (no request for a file of one span)."""
    size = path.stat().st_size if size is None else size
    if size <= target_bytes:
        return [Span(0, size, 1)]
    spans, start, first_line, line, offset, cut = [], 0, 1, 1, 0, target_bytes
    with path.open("rb") as f:  # a Path or an object-store UPath (storage.paths)
        while chunk := f.read(chunk_bytes):
            position = 0
            while offset + len(chunk) > cut:  # the first line end at or after ``cut`` closes a span
                newline = chunk.find(b"\n", max(position, cut - offset))
                if newline < 0:
                    break
                line += chunk.count(b"\n", position, newline + 1)
                position, end = newline + 1, offset + newline + 1
                spans.append(Span(start, end, first_line))
                start, first_line, cut = end, line, end + target_bytes
            line += chunk.count(b"\n", position)
            offset += len(chunk)
    if start < size:
        spans.append(Span(start, size, first_line))
    return spans


def parquet_spans(path: Path, target_bytes: int) -> list[Span]:
    """A Parquet file cut between row groups into spans of about ``target_bytes`` of uncompressed data: ``start`` and
    ``end`` count row groups, ``first_line`` is the span's first row number (1-based), read from the footer alone."""
    import pyarrow.parquet as pq

    with path.open("rb") as f:
        meta = pq.ParquetFile(f).metadata
    spans, start, first_row, size, row = [], 0, 1, 0, 1
    for group in range(meta.num_row_groups):
        info = meta.row_group(group)
        if group > start and size + info.total_byte_size > target_bytes:
            spans.append(Span(start, group, first_row))
            start, first_row, size = group, row, 0
        size += info.total_byte_size
        row += info.num_rows
    spans.append(Span(start, meta.num_row_groups, first_row))
    return spans


def read_spans(fmt: str, path: Path, target_bytes: int, size: int | None = None) -> list[Span]:
    """How a file of a SPLITTABLE format is cut into read tasks: row groups for Parquet, line ends for text."""
    return parquet_spans(path, target_bytes) if fmt in PARQUET_FORMATS else file_spans(path, target_bytes, size=size)


def _lines(path: Path, span: Span | None = None) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, decode error) for every non-blank line (of ``span``, else of the file); bad UTF-8 is
    reported, not skipped; a UTF-8 byte order mark and CRLF line ends are accepted."""
    with contextlib.ExitStack() as stack:
        if span is not None:  # exactly the span's bytes, in one ranged read
            lines = io.BytesIO(read_range(path, span.start, span.end))
        else:
            lines = stack.enter_context(path.open("rb"))
        for number, raw in enumerate(lines, start=span.first_line if span else 1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield number, None, f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
                continue
            if text.strip():
                yield number, text.rstrip("\r\n"), None


def _json_records(path: Path, span: Span | None = None) -> Iterator[tuple[int, str, dict | None, str | None]]:
    for number, text, error in _lines(path, span):
        if error:
            yield number, "", None, error
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            yield number, text, None, f"invalid JSON ({exc.msg} at column {exc.colno})"
            continue
        if not isinstance(value, dict):
            yield number, text, None, f"expected a JSON object, got {type(value).__name__}"
            continue
        yield number, text, value, None


def _bad(source: str | Path, line: int, reason: str, raw: str) -> Row:
    """A bad record: where it is, what is wrong, and its text for the quarantine file."""
    return {"source": str(source), "line": line, "error": reason, "raw": raw[:2000]}


def _guard(convert: Callable[[], Row], source: str, line: int, raw: str | Callable[[], str]) -> Row:
    """``convert``'s fields, or the row set aside. ``raw``: the record's text, or a function giving it (a Parquet
    row is JSON-encoded only when it is kept as text: a bad or skipped row, never a good one)."""
    try:
        fields = convert()
        if fields is None:  # not a record (SNLI's '-' gold label): counted, never trained on
            return {"source": source, "line": line, "error": None, "raw": _text(raw)[:2000], "skipped": True}
        return {**fields, "source": source, "line": line, "error": None, "raw": None}
    except RecordError as exc:
        return _bad(source, line, str(exc), _text(raw))


def _text(raw: str | Callable[[], str]) -> str:
    return raw if isinstance(raw, str) else raw()


def _records(path: Path, convert: Callable[[dict], Row | None], span: Span | None = None,
             partition: dict | None = None) -> Iterator[Row]:
    """JSON-lines files through ``convert`` (None = not a record, e.g. SNLI's '-' gold label). ``partition``: the
    values of the file's ``key=value`` folders, fields of every record that does not hold them itself."""
    for number, raw, value, error in _json_records(path, span):
        if error:
            yield _bad(path, number, error, raw)
            continue
        yield _guard(lambda v=value: convert({**partition, **v} if partition else v), str(path), number, raw)


def _snli(record: dict) -> Row | None:
    if str(record.get("gold_label", "")).strip() == "-":
        return None  # no annotator consensus: SNLI/MNLI mark these as unlabeled
    return pair_record({"text1": record.get("sentence1"), "text2": record.get("sentence2"),
                        "label": record.get("gold_label")})


def _senteval_nli(folder: Path, split: str) -> Iterator[Row]:
    files = [folder / f"{name}.{split}" for name in ("s1", "s2", "labels")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"SentEval NLI layout needs {missing}")
    columns = [f.read_bytes().decode("utf-8").splitlines() for f in files]
    if len({len(c) for c in columns}) != 1:
        raise ValueError(f"{folder}: s1/s2/labels.{split} have different line counts {[len(c) for c in columns]}")
    for number, (s1, s2, label) in enumerate(zip(*columns), start=1):
        raw = f"{s1}\t{s2}\t{label}"
        yield _guard(lambda a=s1, b=s2, c=label: pair_record({"text1": a, "text2": b, "label": c}),
                     str(files[0]), number, raw)


def _csv_rows(path: Path, span: Span | None = None) -> Iterator[tuple[int, list[str] | None, str, str | None]]:
    """(line number, fields, raw text, error) per non-blank line: one record per line (no quoted newlines), so a
    line of bad UTF-8 is one bad record instead of a failed file."""
    for number, text, error in _lines(path, span):
        if error:
            yield number, None, "", error
        else:
            yield number, next(csv.reader([text])), text, None


def _csv_header(path: Path) -> tuple[int, list[str]]:
    """(line number, fields) of the file's first readable line, its header; (0, []) when there is none. Read in
    small blocks: every span of a large CSV reads its header."""
    with open_head(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                return number, next(csv.reader([text.rstrip("\r\n")]))
    return 0, []


def _csv_pairs(path: Path, span: Span | None = None) -> Iterator[Row]:
    """CSV with a header naming text1/sentence1, text2/sentence2, label/gold_label, similarity (other columns
    are ignored). A span of a large file reads the header from the file's head, then its own lines."""
    header_line, header = _csv_header(path)
    for number, fields, raw, error in _csv_rows(path, span):
        if error:
            yield _bad(path, number, error, raw)
            continue
        if number == header_line:
            continue
        row = dict(zip(header, fields))
        record = {"text1": row.get("text1", row.get("sentence1")), "text2": row.get("text2", row.get("sentence2")),
                  "label": row.get("label", row.get("gold_label")), "similarity": row.get("similarity") or None}
        yield _guard(lambda r=record: pair_record(r), str(path), number, raw)


def _stsb_csv(path: Path, span: Span | None = None) -> Iterator[Row]:
    """STS-B CSV without header: sentence1,sentence2,score (0-5, quoted fields)."""
    for number, row, text, error in _csv_rows(path, span):
        if error:
            yield _bad(path, number, error, text)
            continue
        raw = json.dumps(row)
        if len(row) != 3:
            yield _bad(path, number, f"expected 3 fields, got {len(row)}", raw)
            continue
        yield _guard(lambda r=row: sts_record(r[0], r[1], r[2]), str(path), number, raw)


def _senteval_sts(path: Path, span: Span | None = None) -> Iterator[Row]:
    """SentEval sts-*.csv: tab-separated genre, file, year, id, score, s1, s2."""
    for number, text, error in _lines(path, span):
        if error:
            yield _bad(path, number, error, "")
            continue
        parts = text.split("\t")
        if len(parts) < 7:
            yield _bad(path, number, f"expected 7 tab-separated fields, got {len(parts)}", text)
            continue
        yield _guard(lambda p=parts: sts_record(p[5], p[6], p[4]), str(path), number, text)


def _sentences_txt(path: Path, span: Span | None = None) -> Iterator[Row]:
    """One sentence per line (SimCSE's wiki1m_for_simcse.txt); blank lines are not records."""
    for number, text, error in _lines(path, span):
        if error:
            yield _bad(path, number, error, "")
        else:
            yield _guard(lambda t=text: sentence_record({"text": t}), str(path), number, text)


def _senteval_nli_sentences(folder: Path, split: str) -> Iterator[Row]:
    """The distinct sentences of a SentEval NLI folder (s1.<split>, then s2.<split>): an NLI corpus as an unlabeled
    sentence corpus (SNLI repeats each premise for its three hypotheses; each sentence comes once)."""
    seen: set[str] = set()
    for name in ("s1", "s2"):
        path = folder / f"{name}.{split}"
        if not path.exists():
            raise FileNotFoundError(f"SentEval NLI layout needs {path}")
        for row in _sentences_txt(path):
            if row["error"] is None and row["text"] in seen:
                continue
            seen.add(row.get("text") or "")
            yield row


def _ranked_list(record: dict) -> Row:
    sentences = record.get("sentences")
    if not isinstance(sentences, list) or len(sentences) < 2:
        raise RecordError("field 'sentences' must be a list of at least 2 sentences")
    for i, s in enumerate(sentences):
        if not isinstance(s, str) or not s.strip():
            raise RecordError(f"sentence {i} of 'sentences' is empty or not text")
    return {"sentences": sentences}


def _parquet(path: Path, convert: Callable[[dict], Row], span: Span | None = None,
             partition: dict | None = None) -> Iterator[Row]:
    """The rows of a Parquet file (of ``span``'s row groups), a batch at a time: never the whole file as dicts.
    ``partition`` as in ``_records``."""
    import pyarrow.parquet as pq

    with path.open("rb") as f:
        file = pq.ParquetFile(f)
        groups = range(file.num_row_groups) if span is None else range(span.start, span.end)
        number = 1 if span is None else span.first_line
        for batch in file.iter_batches(batch_size=8192, row_groups=list(groups)):
            for record in batch.to_pylist():
                if partition:
                    record = {**partition, **record}
                yield _guard(lambda r=record: convert(r), str(path), number,
                             lambda r=record: json.dumps(r, default=str))
                number += 1


# Formats whose every line (or Parquet row) is a record of its own: a large file is read as many spans (read_spans)
# in parallel.
SPLITTABLE: dict[str, dict[str, Callable[..., Iterator[Row]]]] = {
    "pairs": {"pairs_jsonl": lambda p, span, part=None: _records(p, pair_record, span, part),
              "snli_jsonl": lambda p, span, part=None: _records(p, _snli, span, part),
              "csv": _csv_pairs,
              "parquet": lambda p, span, part=None: _parquet(p, pair_record, span, part)},
    "sts": {"stsb_csv": _stsb_csv, "senteval_sts": _senteval_sts},
    "sentences": {"txt": _sentences_txt, "jsonl": lambda p, span, part=None: _records(p, sentence_record, span, part),
                  "parquet": lambda p, span, part=None: _parquet(p, sentence_record, span, part)},
    "lists": {"jsonl": lambda p, span, part=None: _records(p, _ranked_list, span, part)},
    "triples": {"jsonl": lambda p, span, part=None: _records(p, triple_record, span, part),
                "parquet": lambda p, span, part=None: _parquet(p, triple_record, span, part)},
    "triplets": {"triplets_jsonl": lambda p, span, part=None: _records(p, triplet_record, span, part),
                 "parquet": lambda p, span, part=None: _parquet(p, triplet_record, span, part)},
    "groups": {"groups_jsonl": lambda p, span, part=None: _records(p, group_record, span, part),
               "groups_parquet": lambda p, span, part=None: _parquet(p, group_record, span, part)},
}

PARSERS: dict[str, dict[str, Callable[..., Iterator[Row]]]] = {
    "pairs": {
        "pairs_jsonl": lambda p, split, part=None: _records(p, pair_record, None, part),
        "snli_jsonl": lambda p, split, part=None: _records(p, _snli, None, part),
        "senteval_nli": lambda p, split: _senteval_nli(p, split or "train"),
        "csv": lambda p, split: _csv_pairs(p),
        "parquet": lambda p, split, part=None: _parquet(p, pair_record, None, part),
    },
    "sts": {
        "stsb_csv": lambda p, split: _stsb_csv(p),
        "senteval_sts": lambda p, split: _senteval_sts(p),
    },
    "sentences": {
        "txt": lambda p, split: _sentences_txt(p),
        "jsonl": lambda p, split, part=None: _records(p, sentence_record, None, part),
        "parquet": lambda p, split, part=None: _parquet(p, sentence_record, None, part),
        "senteval_nli": lambda p, split: _senteval_nli_sentences(p, split or "train"),
    },
    "lists": {"jsonl": lambda p, split, part=None: _records(p, _ranked_list, None, part)},
    "triples": {"jsonl": lambda p, split, part=None: _records(p, triple_record, None, part),
                "parquet": lambda p, split, part=None: _parquet(p, triple_record, None, part)},
    "triplets": {"triplets_jsonl": lambda p, split, part=None: _records(p, triplet_record, None, part),
                 "parquet": lambda p, split, part=None: _parquet(p, triplet_record, None, part)},
    "groups": {"groups_jsonl": lambda p, split, part=None: _records(p, group_record, None, part),
               "groups_parquet": lambda p, split, part=None: _parquet(p, group_record, None, part)},
}


def detect_format(kind: str, path: Path) -> str:
    """Pick a parser from the file name (and, for JSON lines, the first record's keys)."""
    if path.is_dir():
        if kind in ("pairs", "sentences") and any(path.glob("s1.*")):
            return "senteval_nli"
        raise ValueError(f"cannot tell the format of folder {path}; set data.format")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "groups_parquet" if kind == "groups" else "parquet"
    if kind == "sts":
        return "senteval_sts" if path.name.startswith("sts-") and _first_line(path).count("\t") >= 6 else "stsb_csv"
    if kind == "pairs":
        if suffix == ".csv":
            return "csv"
        first = _first_line(path)
        return "snli_jsonl" if '"sentence1"' in first or '"gold_label"' in first else "pairs_jsonl"
    if kind == "sentences":
        return "jsonl" if suffix in (".jsonl", ".json") else "txt"
    if kind == "triplets":
        return "triplets_jsonl"
    if kind == "groups":
        return "groups_jsonl"
    return "jsonl"


def has_nli_labels(path: Path) -> bool:
    """Whether a JSON-lines file's first record carries an NLI label (``label`` or SNLI's ``gold_label``): labelled
    pairs, rather than plain (query, positive) rows."""
    first = _first_line(path)
    return '"label"' in first or '"gold_label"' in first


def _first_line(path: Path) -> str:
    with open_head(path) as f:
        return io.TextIOWrapper(f, encoding="utf-8", errors="replace").readline()


FIELDS = {
    "pairs": ("text1", "text2", "label", "similarity"),
    "sts": ("text1", "text2", "score", "similarity"),
    "sentences": ("text", "negative"),
    "lists": ("sentences",),
    "triples": ("head", "tail", "relation", "negative"),
    "triplets": ("text1", "text2", "text_neg", "label", "similarity"),
    "groups": ("query", "positives", "negatives", "positive_scores", "negative_scores"),
}


def groups_without_negatives(table):
    """Which query groups of an Arrow batch hold no negative (an empty or missing list): mining does not write them,
    and training with data.group_size above 1 leaves them out."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.equal(pc.list_value_length(table["negatives"]), 0), True)


def keep_groups_with_negatives(table):
    """An Arrow batch of query groups without the ones that hold no negative."""
    import pyarrow.compute as pc

    return table.filter(pc.invert(groups_without_negatives(table)))


def group_table(columns: dict[str, list]):
    """Query groups as an Arrow table of fixed types (lists of texts and of scores), whatever a batch holds: a
    batch whose lists are all empty would otherwise give list<null> columns that other batches' do not join."""
    import pyarrow as pa

    texts, scores = pa.list_(pa.large_string()), pa.list_(pa.float64())
    types = {"query": pa.large_string(), "positives": texts, "negatives": texts, "positive_scores": scores,
             "negative_scores": scores}
    return pa.Table.from_pydict(columns, schema=pa.schema([(name, types.get(name, pa.large_string()))
                                                            for name in columns]))


def parse(kind: str, fmt: str, path: Path, split: str | None = None, span: Span | None = None,
          partition: dict[str, str | None] | None = None) -> Iterator[Row]:
    """Every raw record of ``path`` (or of its ``span``, for a format in SPLITTABLE) as a row with all of the kind's
    fields (None on bad rows) plus ``source``, ``line``, ``error`` (None when good), ``raw`` (the text of a bad row)
    and ``skipped``. ``partition``: the values of the file's ``key=value`` folders (a Hive or Spark layout), fields
    of each record that lacks them; only the record formats (JSON lines, Parquet) take them."""
    if kind not in PARSERS:
        raise ValueError(f"unknown corpus kind {kind!r}; known: {CORPUS_KINDS}")
    if fmt not in PARSERS[kind]:
        raise ValueError(f"format {fmt!r} does not hold {kind}; use one of {sorted(PARSERS[kind])}")
    empty = dict.fromkeys(FIELDS[kind])
    if partition and fmt not in RECORD_FORMATS:
        raise ValueError(f"{path}: key=value folders ({', '.join(partition)}) give fields to JSON-lines and Parquet "
                         f"records only, not to data.format {fmt!r}")
    extra = {"part": partition} if partition else {}
    rows = SPLITTABLE[kind][fmt](path, span, **extra) if span is not None else PARSERS[kind][fmt](path, split, **extra)
    for row in rows:
        yield {**empty, "skipped": False, **row}


__all__ = ["CORPUS_KINDS", "PARSERS", "SPLITTABLE", "Span", "file_spans", "parquet_spans", "read_spans", "NO_LABEL",
           "detect_format", "normalise_label", "parse"]
