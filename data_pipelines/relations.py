"""RSE training data: relation triples (head, relation, tail, hard negative) from any mix of sources.

A source is a triples corpus ({head, tail, relation, negative?}), NLI pairs mapped to entailment triples with the
contradiction hypothesis as the in-relation hard negative, or a sentence corpus mapped to ``same-sent`` (head = tail;
the two dropout views make the pair). Then, seeded: a held-out slice per relation for relation prediction,
per-relation caps and sampling weights, and a hard negative for every triple that has none: a random tail of the same
relation that is not its own tail (the paper's in-relation negatives). A relation is prepared in shares of at most
~1M triples (content-hashed slots, one Ray task each), so a 100M-row source is a hundred tasks, not one process."""

from __future__ import annotations

import hashlib
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


RELATION_TASK_ROWS = 1_000_000  # triples one task prepares at most (with slot imbalance, a few % more): ~300 MB
SLOT_BITS = 12
SLOTS = 1 << SLOT_BITS  # a relation's triples split into this many content-hashed slots; a task takes a run of them


@dataclass(frozen=True)
class Share:
    """One task's share of a relation: its triples held out, kept after the cap, and drawn again for a fractional
    sampling weight (counts apportioned from the relation's totals, so the totals do not depend on the split)."""

    relation: str
    bucket: int
    buckets: int
    rows: int  # the share's triples: what its task must be handed, whole
    heldout: int
    kept: int
    extra: int


def relation_plan(slot_counts: dict[str, np.ndarray], data_cfg,
                  rows_per_task: int = RELATION_TASK_ROWS) -> dict[tuple[str, int], Share]:
    """Each relation split into ``ceil(rows / rows_per_task)`` tasks by content-hashed slots, with the relation's
    held-out slice (min(data.heldout, rows // 2)), cap and fractional weight's extra draws apportioned over its tasks
    by their rows (largest remainder: the totals are exactly those of one task per relation)."""
    plan = {}
    for name, slots in slot_counts.items():
        total = int(slots.sum())
        buckets = min(SLOTS, max(1, -(-total // rows_per_task)))
        rows = np.bincount(np.arange(SLOTS) * buckets // SLOTS, weights=slots, minlength=buckets).astype(np.int64)
        heldout = _apportion(min(data_cfg.heldout, total // 2), rows)
        left = rows - heldout
        cap = data_cfg.caps.get(name)
        kept = _apportion(int(left.sum()) if cap is None else min(cap, int(left.sum())), left)
        weight = data_cfg.weights.get(name, 1.0)
        extra = _apportion(round((weight - math.floor(weight)) * int(kept.sum())), kept)
        for b in range(buckets):
            plan[name, b] = Share(name, b, buckets, int(rows[b]), int(heldout[b]), int(kept[b]), int(extra[b]))
    return plan


def planned_counts(plan: dict[tuple[str, int], Share], names: list[str], data_cfg) -> dict[str, int]:
    """Training triples per relation, as the plan makes them (each kept triple ``floor(weight)`` times, plus the extra
    draws): no pass over the prepared rows to count them."""
    counts = {name: 0 for name in names}
    for share in plan.values():
        counts[share.relation] += share.kept * math.floor(data_cfg.weights.get(share.relation, 1.0)) + share.extra
    return counts


def _apportion(total: int, sizes: np.ndarray) -> np.ndarray:
    """``total`` split over parts in proportion to ``sizes`` (largest remainder, ties to the first part); no part
    gets more than its size when total <= sum(sizes)."""
    whole = int(sizes.sum())
    if whole == 0:
        return np.zeros_like(sizes)
    base, remainder = np.divmod(total * sizes, whole)
    order = np.lexsort((np.arange(len(sizes)), -remainder))
    base[order[:total - int(base.sum())]] += 1
    return base


def _slots(frame, seed: int) -> np.ndarray:
    """Each triple's slot, from a seeded hash of its content: the same triple lands in the same slot whatever the
    block it arrived in or the worker that hashed it."""
    import pandas as pd

    key = hashlib.blake2b(str(seed).encode(), digest_size=8).hexdigest()
    content = frame[["head", "tail", "negative"]].fillna("")  # a missing negative hashes alike from any reader
    hashed = pd.util.hash_pandas_object(content, index=False, hash_key=key)
    return (hashed.to_numpy() >> np.uint64(64 - SLOT_BITS)).astype(np.int64)


def prepare_share(rows, share: Share, names: list[str], data_cfg, seed: int):
    """One task's share of a relation (a pandas frame, all of one relation): sorted (so the result does not depend on
    the order rows arrived in), then seeded by (seed, the relation's place in the table, the share): its held-out
    slice (``split`` heldout), its rows kept under the cap, its draws for the sampling weight and a hard negative for
    every triple without one; with ``relation_id``."""
    import pandas as pd

    if len(rows) != share.rows:  # a share split over calls would apply its counts to each piece
        raise RuntimeError(f"share {share.bucket} of relation {share.relation!r} arrived with {len(rows)} of its "
                           f"{share.rows} triples")
    index = names.index(share.relation)
    rng = np.random.default_rng([seed, index] if share.buckets == 1 else [seed, index, share.bucket])
    rows = rows[TRIPLE_COLUMNS].sort_values(["head", "tail", "negative"], na_position="first").reset_index(drop=True)
    rows = rows.iloc[rng.permutation(len(rows))].reset_index(drop=True)
    heldout, rows = rows.iloc[:share.heldout].assign(split="heldout"), rows.iloc[share.heldout:]
    rows = rows.iloc[:share.kept]
    whole = math.floor(data_cfg.weights.get(share.relation, 1.0))
    extra = rows.iloc[np.sort(rng.choice(len(rows), size=share.extra, replace=False))]
    rows = _with_negatives(pd.concat([rows] * whole + [extra], ignore_index=True), rng, share).assign(split="train")
    return pd.concat([rows, heldout], ignore_index=True).assign(relation_id=np.int64(index))


def prepare_triples(frame, data_cfg, seed: int, rows_per_task: int = RELATION_TASK_ROWS) -> TripleData:
    """``prepare_triples_ds`` on a pandas frame, in this process (small data, tests)."""
    import pandas as pd

    slot_counts = _add_slot_counts({}, _count_slots(frame, seed))
    names = relation_set({n: int(c.sum()) for n, c in slot_counts.items()}, data_cfg)
    plan = relation_plan(slot_counts, data_cfg, rows_per_task)
    shares = frame.assign(_bucket=_buckets(frame, plan, seed)).groupby(["relation", "_bucket"])
    parts = [prepare_share(group, plan[name, bucket], names, data_cfg, seed) for (name, bucket), group in shares]
    both = pd.concat(parts, ignore_index=True).sort_values("relation_id", kind="stable").reset_index(drop=True)
    train, heldout = both[both["split"] == "train"], both[both["split"] == "heldout"]
    if train.empty:
        raise ValueError("no training triples left after data.heldout, data.caps and data.weights")
    counts = planned_counts(plan, names, data_cfg)
    return TripleData(train=train.drop(columns="split").reset_index(drop=True),
                      heldout=heldout.drop(columns="split").reset_index(drop=True), relations=names, counts=counts)


def prepare_triples_ds(ds, data_cfg, seed: int, rows_per_task: int = RELATION_TASK_ROWS) -> TripleData:
    """Relation set, held-out slice, caps, sampling weights and hard negatives, all seeded, each relation prepared in
    shares of at most ~``rows_per_task`` triples, one Ray task each (``relation_plan``, ``prepare_share``): the
    training triples stay a Ray Dataset in the object store; only the slot counts and the held-out triples
    (data.heldout per relation) reach the driver."""
    import pandas as pd

    slot_counts: dict[str, np.ndarray] = {}
    for counts in ds.map_batches(lambda frame: _count_slots(frame, seed), batch_format="pandas").iter_batches(
            batch_format="pandas", batch_size=None):
        _add_slot_counts(slot_counts, counts)
    names = relation_set({n: int(c.sum()) for n, c in slot_counts.items()}, data_cfg)
    plan = relation_plan(slot_counts, data_cfg, rows_per_task)
    shares = sorted(plan)  # one group each: map_groups hands a task a whole group, never a piece of one
    number = {key: i for i, key in enumerate(shares)}

    def numbered(frame):
        return frame.assign(_share=[number[key] for key in zip(frame["relation"], _buckets(frame, plan, seed))])

    both = (ds.map_batches(numbered, batch_format="pandas")
            .groupby("_share", num_partitions=len(shares))
            .map_groups(lambda rows: prepare_share(rows, plan[shares[int(rows["_share"].iloc[0])]], names, data_cfg,
                                                   seed), batch_format="pandas").materialize())
    train = both.map_batches(_split_rows("train"), batch_format="pyarrow").materialize()
    counts = planned_counts(plan, names, data_cfg)
    if not sum(counts.values()):
        raise ValueError("no training triples left after data.heldout, data.caps and data.weights")
    heldout = pd.DataFrame(both.map_batches(_split_rows("heldout"), batch_format="pyarrow").take_all(),
                           columns=[*TRIPLE_COLUMNS, "relation_id"])
    return TripleData(train=train, heldout=heldout.sort_values(["relation_id", "head", "tail"], ignore_index=True),
                      relations=names, counts=counts)


def _split_rows(split: str):
    """A block's rows of one split (train or heldout), without the split column: a columnar filter, not per row."""
    return lambda table: table.filter(pc.equal(table["split"], split)).drop_columns(["split"])


def _count_slots(frame, seed: int):
    """Triples per (relation, slot) of one block: a few thousand rows per relation, whatever the block's size."""
    import pandas as pd

    return (pd.DataFrame({"relation": frame["relation"].to_numpy(), "slot": _slots(frame, seed)})
            .value_counts().reset_index(name="count"))


def _add_slot_counts(total: dict[str, np.ndarray], counts) -> dict[str, np.ndarray]:
    for name, group in counts.groupby("relation"):
        np.add.at(total.setdefault(name, np.zeros(SLOTS, np.int64)), group["slot"].to_numpy(),
                  group["count"].to_numpy())
    return total


def _buckets(frame, plan: dict[tuple[str, int], Share], seed: int) -> np.ndarray:
    """Each triple's share of its relation: a run of slots (``relation_plan``)."""
    buckets = {name: share.buckets for (name, _), share in plan.items()}
    return _slots(frame, seed) * frame["relation"].map(buckets).to_numpy(dtype=np.int64) // SLOTS


def _with_negatives(rows, rng, share: Share):
    """A hard negative for every triple without one: a random distinct tail of the same relation (of this share of
    it: a seeded random subset, all of it below ``rows_per_task``), never its own."""
    missing = rows["negative"].isna().to_numpy()
    if not missing.any():
        return rows
    pool = np.array(sorted(rows["tail"].unique()), dtype=object)
    if len(pool) < 2:
        where = "" if share.buckets == 1 else f" (in share {share.bucket} of {share.buckets} of its triples)"
        raise ValueError(f"relation {share.relation!r} has one distinct tail{where}: no in-relation negative can be "
                         f"drawn for its triples")
    position = {t: i for i, t in enumerate(pool)}
    own = np.array([position[t] for t in rows["tail"][missing]])
    pick = rng.integers(0, len(pool) - 1, size=len(own))
    pick = pick + (pick >= own)  # skip the triple's own tail: uniform over the others
    rows = rows.copy()
    rows.loc[missing, "negative"] = pool[pick]
    return rows
