"""Corpora from Hugging Face datasets: ``data.train: hf:<dataset>[:<config>]`` with ``data.split``, e.g.
``hf:stanfordnlp/snli``, ``hf:nyu-mll/multi_nli``, ``hf:sentence-transformers/stsb``, ``hf:nyu-mll/glue:mnli``.
``datasets.load_dataset`` fetches hub ids when a hub is reachable and reads a local dataset folder offline.
Rows go through the same validation as files: the "line" of a row is its index in the split (1-based)."""

from __future__ import annotations

import json
import math
from typing import Any

from data_pipelines.formats import FIELDS
from data_pipelines.records import (
    LABELS,
    NO_LABEL,
    RecordError,
    pair_record,
    sentence_record,
    sts_record,
    triple_record,
    triplet_record,
)

HUB_PREFIX = "hf:"
# Column names of the common hub layouts, by the field they fill (first present wins).
COLUMNS = {
    "pairs": {"text1": ("text1", "sentence1", "premise"), "text2": ("text2", "sentence2", "hypothesis"),
              "label": ("label", "gold_label"), "similarity": ("similarity",)},
    "sts": {"text1": ("sentence1", "text1"), "text2": ("sentence2", "text2"), "score": ("score", "similarity", "label")},
    "sentences": {"text": ("text", "sentence"), "negative": ("negative",)},
    "triples": {"head": ("head", "anchor", "sentence1"), "tail": ("tail", "positive", "sentence2"),
                "relation": ("relation",), "negative": ("negative",)},
    "triplets": {"text1": ("text1", "query", "anchor", "question"), "text2": ("text2", "positive", "answer"),
                 "negative": ("negative",)},
}
LINE = "__raoe_line"


def is_hub_source(path: Any) -> bool:
    return str(path).startswith(HUB_PREFIX)


def hub_spec(source: str) -> tuple[str, str | None]:
    """``hf:name[:config]`` -> (name, config); a config never contains '/', so local paths with ':' survive."""
    spec = source.removeprefix(HUB_PREFIX)
    name, sep, config = spec.rpartition(":")
    if not sep or "/" in config or not name:
        name, config = spec, ""
    if not name:
        raise ValueError(f"data.train {source!r}: expected hf:<dataset>[:<config>], e.g. hf:stanfordnlp/snli")
    return name, config or None


def load_hub_split(source: str, split: str | None):
    """The split as a ``datasets.Dataset`` (Arrow, memory-mapped from the datasets cache)."""
    import datasets

    name, config = hub_spec(source)
    try:
        return datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; the user needs the source named
        raise FileNotFoundError(f"cannot load {source!r} split {split or 'train'!r} with datasets.load_dataset: "
                                f"{exc}") from exc


def column_map(kind: str, columns: list[str]) -> dict[str, str]:
    """Field -> the dataset's column for it; a missing required column is an error naming what was looked for."""
    if kind not in COLUMNS:
        raise ValueError(f"hub datasets hold pairs, sts, sentences, triples or triplets, not {kind!r}")
    found = {}
    for field, candidates in COLUMNS[kind].items():
        column = next((c for c in candidates if c in columns), None)
        if column is None and field not in ("similarity", "negative", "relation"):  # optional fields
            raise ValueError(f"no column for {field!r} (looked for {list(candidates)}); the dataset has {columns}")
        if column is not None:
            found[field] = column
    return found


def label_names(split, column: str) -> list[str] | None:
    """A ClassLabel column's names, checked to be NLI labels: integers of another task (GLUE RTE's
    not_entailment, MRPC's equivalent) must not be read as entailment/neutral/contradiction."""
    from datasets import ClassLabel

    feature = split.features.get(column)
    if not isinstance(feature, ClassLabel):
        return None
    unknown = [n for n in feature.names if n.strip().lower() not in LABELS]
    if unknown:
        raise ValueError(f"label column {column!r} holds {feature.names}, not NLI labels "
                         f"(entailment, neutral, contradiction); raoe will not guess what {unknown} mean")
    return list(feature.names)


def sts_scale(split, column: str) -> float:
    """Gold scores 0-5 (STS-B as published) or already 0-1 (sentence-transformers/stsb), read off the split."""
    scores = [s for s in split[column] if isinstance(s, (int, float)) and math.isfinite(s)]
    return 5.0 if scores and max(scores) > 1.0 else 1.0


def hub_record(kind: str, row: dict[str, Any], columns: dict[str, str], scale: float,
               names: list[str] | None = None) -> dict[str, Any] | None:
    """One hub row -> the kind's fields (None: not a record, e.g. SNLI's label -1 for no gold label)."""
    get = {field: row.get(column) for field, column in columns.items()}
    if kind == "pairs":
        if get.get("label") in (NO_LABEL, "-"):
            return None
        if names is not None and isinstance(get.get("label"), int) and 0 <= get["label"] < len(names):
            get["label"] = names[get["label"]]  # by the dataset's own ClassLabel names, not by position
        return pair_record(get)
    if kind == "sts":
        return sts_record(get["text1"], get["text2"], get["score"], scale=scale)
    if kind == "triples":
        return triple_record(get)
    if kind == "triplets":
        return triplet_record(get)
    return sentence_record(get)


def hub_rows(kind: str, source: str, split: str | None):
    """A Ray Dataset of raw rows (fields + source/line/error/raw/skipped), like the file parsers produce."""
    import ray

    if kind not in COLUMNS:
        raise ValueError(f"hub datasets hold pairs, sts, sentences, triples or triplets, not {kind!r}")
    data = load_hub_split(source, split)
    columns = column_map(kind, data.column_names)
    scale = sts_scale(data, columns["score"]) if kind == "sts" else 1.0
    names = label_names(data, columns["label"]) if kind == "pairs" else None
    data = data.select_columns(list(columns.values()))  # MNLI also carries parse trees: leave them behind
    where = f"{source}[{split or 'train'}]"
    empty = dict.fromkeys(FIELDS[kind])

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        line = int(row[LINE])
        row = {k: v for k, v in row.items() if k != LINE}
        raw = json.dumps(row, default=str)[:2000]
        base = {**empty, "source": where, "line": line, "raw": None, "error": None, "skipped": False}
        try:
            fields = hub_record(kind, row, columns, scale, names)
        except RecordError as exc:
            return {**base, "error": str(exc), "raw": raw}
        if fields is None:
            return {**base, "skipped": True}
        return {**base, **fields}

    # Arrow blocks straight from the memory-mapped table, enough of them that the conversion runs in parallel
    # (ray.data.from_huggingface re-resolves the dataset by name and falls back to a single block); each slice gets
    # its row numbers as an Arrow column of its own (no Python list of every row number on the driver).
    table = data.with_format("arrow")[:]
    size = -(-len(table) // max(1, min(200, len(table) // 5000))) or 1
    blocks = [_numbered(table.slice(start, size), start) for start in range(0, len(table), size)]
    return ray.data.from_arrow(blocks or [_numbered(table, 0)]).map(convert)


def _numbered(table, start: int):
    import numpy as np
    import pyarrow as pa

    return table.append_column(LINE, pa.array(np.arange(start + 1, start + table.num_rows + 1, dtype=np.int64)))
