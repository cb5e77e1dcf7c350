"""RSE training data: relation triples (head, relation, tail, hard negative) from any mix of sources.

A source is a triples corpus ({head, tail, relation, negative?}), NLI pairs mapped to entailment triples with the
contradiction hypothesis as the in-relation hard negative, or a sentence corpus mapped to ``same-sent`` (head = tail;
the two dropout views make the pair). Then, seeded: a held-out slice per relation for relation prediction,
per-relation caps and sampling weights, and a hard negative for every triple that has none: a random tail of the same
relation that is not its own tail (the paper's in-relation negatives)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data_pipelines.hub import is_hub_source
from data_pipelines.readers import DataReport, corpus_files, count_where, load_corpus
from data_pipelines.triplets import nli_triplets
from jobconfig.schema import TripleSource
from storage.paths import storage_path, writable_path

TRIPLE_COLUMNS = ["head", "tail", "relation", "negative"]
TRIPLE_SCHEMA = pa.schema([(c, pa.string()) for c in TRIPLE_COLUMNS])
CORPUS = {"triples": "triples", "nli": "pairs", "same-sent": "sentences"}  # reader kind of each mapping
DEFAULT_RELATION = {"nli": "entailment", "same-sent": "same-sent"}


@dataclass
class TripleData:
    """The prepared triples: training rows (with ``relation_id``), held-out rows, and the relation set."""

    train: Any  # pandas.DataFrame (prepare_triples) or a Ray Dataset in the object store (prepare_triples_ds)
    heldout: "pd.DataFrame"  # noqa: F821
    relations: list[str]
    counts: dict[str, int] = field(default_factory=dict)  # training triples per relation (after caps, weights)


def sources(data_cfg) -> list:
    """data.train (with data.format/split/mapping/relation/max_rows/shuffle_seed) followed by data.sources."""
    first = []
    if data_cfg.train:
        first = [TripleSource(train=data_cfg.train, format=data_cfg.format, split=data_cfg.split,
                              mapping=data_cfg.mapping, relation=data_cfg.relation, max_rows=data_cfg.max_rows,
                              shuffle_seed=data_cfg.shuffle_seed)]
    every = first + list(data_cfg.sources)
    if not every:
        raise ValueError("data.train (or data.sources) must name the relation triples")

    for source in every:  # every path and format checked before any source is read
        if not is_hub_source(source.train):
            corpus_files(source.train, CORPUS[source.mapping], source.format)
    return every


def _as_triples(ds, source):
    """A validated corpus of the source's reader kind -> a Ray Dataset of triples (TRIPLE_COLUMNS, one schema)."""
    relation = source.relation or DEFAULT_RELATION.get(source.mapping)
    if source.mapping == "triples" and not source.relation:
        missing = count_where(ds, lambda table: pc.is_null(table["relation"]))
        if missing:
            raise ValueError(f"{missing} triples of {source.train} have no 'relation'; give every row one, or name "
                             f"the relation of the whole source with its 'relation' key")
    if source.mapping == "nli":
        ds = nli_triplets(ds)
    columns = {"triples": ("head", "tail", "negative"), "nli": ("text1", "text2", "text_neg"),
               "same-sent": ("text", "text", None)}[source.mapping]

    def to_triples(table):
        rows = table.num_rows
        head, tail, negative = (table[c] if c in table.column_names else pa.nulls(rows) for c in columns)
        named = table["relation"] if relation is None else pa.array([relation] * rows)
        return pa.Table.from_arrays([head.cast(pa.string()), tail.cast(pa.string()), named.cast(pa.string()),
                                     negative.cast(pa.string())], schema=TRIPLE_SCHEMA)

    return ds.map_batches(to_triples, batch_format="pyarrow")


def load_triples(data_cfg, quarantine_path: str | Path):
    """Every source read and validated (bad rows named or quarantined into one file), as one Ray Dataset of triples
    (materialised in the object store), with the readers' combined DataReport."""
    stem = str(quarantine_path).removesuffix(".jsonl")
    parts, report, quarantined = [], DataReport(format="+".join(s.format for s in sources(data_cfg))), []
    for i, source in enumerate(sources(data_cfg)):
        part = f"{stem}-{i}.jsonl"
        ds, got = load_corpus(CORPUS[source.mapping], source.train, fmt=source.format, split=source.split,
                              max_rows=source.max_rows, shuffle_seed=source.shuffle_seed,
                              on_bad_record=data_cfg.on_bad_record, quarantine_path=part)
        triples = _as_triples(ds, source).materialize()
        print(f"[raoe] {source.train} ({source.mapping}): {triples.count()} triples from {got.rows_written} records",
              flush=True)
        parts.append(triples)
        report.rows_in += got.rows_in
        report.rows_written += got.rows_written
        report.rows_quarantined += got.rows_quarantined
        report.rows_without_gold += got.rows_without_gold
        report.files += got.files
        if got.quarantine_path:
            quarantined.append(storage_path(got.quarantine_path))
    if quarantined:  # one quarantine file for the job, whatever the number of sources
        target = writable_path(quarantine_path)
        with target.open("wb") as out:
            for part in quarantined:
                out.write(part.read_bytes())
                part.unlink()
        report.quarantine_path = str(target)
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0], report


def relation_set(counts: dict[str, int], data_cfg) -> list[str]:
    """The relation table's names (data.relations, else the relations present, sorted), checked against the
    relations present (name -> triples) and the names data.caps and data.weights use."""
    present = sorted(counts)
    if data_cfg.relations is not None:
        unknown = sorted(set(present) - set(data_cfg.relations))
        if unknown:
            raise ValueError(f"relation(s) {({r: counts[r] for r in unknown})} (name: triples) are not in "
                             f"data.relations {data_cfg.relations}")
        names = list(data_cfg.relations)
    else:
        names = present
    for key, table in (("data.caps", data_cfg.caps), ("data.weights", data_cfg.weights)):
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise ValueError(f"{key} names relation(s) {unknown} that are not in the relation set {names}")
    return names


def prepare_relation(rows, names: list[str], data_cfg, seed: int):
    """One relation's triples (a pandas frame, all of one relation): sorted (so the result does not depend on the
    order rows arrived in), then seeded by (seed, the relation's place in the table): a held-out slice
    (``split`` heldout), the cap, the sampling weight and a hard negative for every triple without one; with
    ``relation_id``."""
    import pandas as pd

    name = rows["relation"].iloc[0]
    index = names.index(name)
    rng = np.random.default_rng([seed, index])
    rows = rows[TRIPLE_COLUMNS].sort_values(["head", "tail", "negative"], na_position="first").reset_index(drop=True)
    rows = rows.iloc[rng.permutation(len(rows))].reset_index(drop=True)
    held = min(data_cfg.heldout, len(rows) // 2)
    heldout, rows = rows.iloc[:held].assign(split="heldout"), rows.iloc[held:]
    cap = data_cfg.caps.get(name)
    if cap is not None and len(rows) > cap:
        rows = rows.iloc[:cap]
    weight = data_cfg.weights.get(name, 1.0)
    whole, share = math.floor(weight), weight - math.floor(weight)
    extra = rows.iloc[np.sort(rng.choice(len(rows), size=round(share * len(rows)), replace=False))]
    rows = _with_negatives(pd.concat([rows] * whole + [extra], ignore_index=True), rng).assign(split="train")
    return pd.concat([rows, heldout], ignore_index=True).assign(relation_id=np.int64(index))


def prepare_triples(frame, data_cfg, seed: int) -> TripleData:
    """``prepare_triples_ds`` on a pandas frame, in this process (small data, tests)."""
    import pandas as pd

    names = relation_set(frame["relation"].value_counts().to_dict(), data_cfg)
    parts = [prepare_relation(group, names, data_cfg, seed) for _, group in frame.groupby("relation")]
    both = pd.concat(parts, ignore_index=True).sort_values("relation_id", kind="stable").reset_index(drop=True)
    train, heldout = both[both["split"] == "train"], both[both["split"] == "heldout"]
    if train.empty:
        raise ValueError("no training triples left after data.heldout, data.caps and data.weights")
    counts = {n: int((train["relation"] == n).sum()) for n in names}
    return TripleData(train=train.drop(columns="split").reset_index(drop=True),
                      heldout=heldout.drop(columns="split").reset_index(drop=True), relations=names, counts=counts)


def relation_counts(ds) -> dict[str, int]:
    """Triples per relation, counted block by block and added up here (a few names: no shuffle needed)."""
    def counted(table):
        counts = pc.value_counts(table["relation"])
        return pa.table({"relation": counts.field("values"), "count": counts.field("counts")})

    total: dict[str, int] = {}
    for row in ds.map_batches(counted, batch_format="pyarrow").take_all():
        total[row["relation"]] = total.get(row["relation"], 0) + int(row["count"])
    return total


def prepare_triples_ds(ds, data_cfg, seed: int) -> TripleData:
    """Relation set, held-out slice, caps, sampling weights and hard negatives, all seeded, one relation per Ray
    task (``prepare_relation``): the training triples stay a Ray Dataset in the object store; only the counts and
    the held-out triples (data.heldout per relation) reach the driver."""
    import pandas as pd

    names = relation_set(relation_counts(ds), data_cfg)
    both = ds.groupby("relation").map_groups(lambda rows: prepare_relation(rows, names, data_cfg, seed),
                                             batch_format="pandas").materialize()
    train = both.filter(lambda row: row["split"] == "train").drop_columns(["split"]).materialize()
    counts = {n: 0 for n in names} | relation_counts(train)
    if not sum(counts.values()):
        raise ValueError("no training triples left after data.heldout, data.caps and data.weights")
    heldout = pd.DataFrame(both.filter(lambda row: row["split"] == "heldout").drop_columns(["split"]).take_all(),
                           columns=[*TRIPLE_COLUMNS, "relation_id"])
    return TripleData(train=train, heldout=heldout.sort_values(["relation_id", "head", "tail"], ignore_index=True),
                      relations=names, counts=counts)


def _with_negatives(rows, rng):
    """A hard negative for every triple without one: a random distinct tail of the same relation, never its own."""
    missing = rows["negative"].isna().to_numpy()
    if not missing.any():
        return rows
    pool = np.array(sorted(rows["tail"].unique()), dtype=object)
    if len(pool) < 2:
        raise ValueError(f"relation {rows['relation'].iloc[0]!r} has one distinct tail: no in-relation negative "
                         f"can be drawn for its triples")
    position = {t: i for i, t in enumerate(pool)}
    own = np.array([position[t] for t in rows["tail"][missing]])
    pick = rng.integers(0, len(pool) - 1, size=len(own))
    pick = pick + (pick >= own)  # skip the triple's own tail: uniform over the others
    rows = rows.copy()
    rows.loc[missing, "negative"] = pool[pick]
    return rows
