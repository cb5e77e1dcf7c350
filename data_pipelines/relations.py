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

import numpy as np

from data_pipelines.hub import is_hub_source
from data_pipelines.readers import DataReport, corpus_files, load_corpus
from data_pipelines.triplets import nli_triplets
from jobconfig.schema import TripleSource

TRIPLE_COLUMNS = ["head", "tail", "relation", "negative"]
CORPUS = {"triples": "triples", "nli": "pairs", "same-sent": "sentences"}  # reader kind of each mapping
DEFAULT_RELATION = {"nli": "entailment", "same-sent": "same-sent"}


@dataclass
class TripleData:
    """The prepared triples: training rows (with ``relation_id``), held-out rows, and the relation set."""

    train: "pd.DataFrame"  # noqa: F821
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
    """A validated corpus of the source's reader kind -> a pandas frame of triples."""
    import pandas as pd

    if source.mapping == "triples":
        frame = ds.to_pandas()
        if source.relation:
            frame["relation"] = source.relation
        missing = int(frame["relation"].isna().sum())
        if missing:
            raise ValueError(f"{missing} triples of {source.train} have no 'relation'; give every row one, or name "
                             f"the relation of the whole source with its 'relation' key")
        return frame[TRIPLE_COLUMNS]
    relation = source.relation or DEFAULT_RELATION[source.mapping]
    if source.mapping == "nli":
        frame = nli_triplets(ds).to_pandas()
        return pd.DataFrame({"head": frame["text1"], "tail": frame["text2"], "relation": relation,
                             "negative": frame["text_neg"]})
    frame = ds.to_pandas()
    return pd.DataFrame({"head": frame["text"], "tail": frame["text"], "relation": relation, "negative": None})


def load_triples(data_cfg, quarantine_path: str | Path):
    """Every source read and validated (bad rows named or quarantined into one file), as one frame of triples,
    with the readers' combined DataReport."""
    import pandas as pd

    quarantine_path = Path(quarantine_path)
    frames, report, quarantined = [], DataReport(format="+".join(s.format for s in sources(data_cfg))), []
    for i, source in enumerate(sources(data_cfg)):
        part = quarantine_path.with_name(f"{quarantine_path.stem}-{i}.jsonl")
        ds, got = load_corpus(CORPUS[source.mapping], source.train, fmt=source.format, split=source.split,
                              max_rows=source.max_rows, shuffle_seed=source.shuffle_seed,
                              on_bad_record=data_cfg.on_bad_record, quarantine_path=part)
        frame = _as_triples(ds, source)
        print(f"[raoe] {source.train} ({source.mapping}): {len(frame)} triples from {got.rows_written} records",
              flush=True)
        frames.append(frame)
        report.rows_in += got.rows_in
        report.rows_written += got.rows_written
        report.rows_quarantined += got.rows_quarantined
        report.rows_without_gold += got.rows_without_gold
        report.files += got.files
        if got.quarantine_path:
            quarantined.append(Path(got.quarantine_path))
    if quarantined:  # one quarantine file for the job, whatever the number of sources
        with open(quarantine_path, "w", encoding="utf-8") as out:
            for part in quarantined:
                out.write(part.read_text(encoding="utf-8"))
                part.unlink()
        report.quarantine_path = str(quarantine_path.resolve())
    return pd.concat(frames, ignore_index=True), report


def prepare_triples(frame, data_cfg, seed: int) -> TripleData:
    """Relation set, held-out slice, caps, sampling weights and hard negatives, all seeded."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    present = sorted(frame["relation"].unique())
    if data_cfg.relations is not None:
        unknown = sorted(set(present) - set(data_cfg.relations))
        if unknown:
            counts = {r: int((frame["relation"] == r).sum()) for r in unknown}
            raise ValueError(f"relation(s) {counts} (name: triples) are not in data.relations {data_cfg.relations}")
        names = list(data_cfg.relations)
    else:
        names = present
    for key, table in (("data.caps", data_cfg.caps), ("data.weights", data_cfg.weights)):
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise ValueError(f"{key} names relation(s) {unknown} that are not in the relation set {names}")
    train_parts, heldout_parts, counts = [], [], {}
    for name in names:
        rows = frame[frame["relation"] == name].reset_index(drop=True)
        rows = rows.iloc[rng.permutation(len(rows))].reset_index(drop=True)
        held = min(data_cfg.heldout, len(rows) // 2)
        heldout_parts.append(rows.iloc[:held])
        rows = rows.iloc[held:]
        cap = data_cfg.caps.get(name)
        if cap is not None and len(rows) > cap:
            rows = rows.iloc[:cap]
        weight = data_cfg.weights.get(name, 1.0)
        whole, share = math.floor(weight), weight - math.floor(weight)
        extra = rows.iloc[np.sort(rng.choice(len(rows), size=round(share * len(rows)), replace=False))]
        rows = pd.concat([rows] * whole + [extra], ignore_index=True)
        rows = _with_negatives(rows, rng)
        counts[name] = len(rows)
        train_parts.append(rows)
    train = pd.concat(train_parts, ignore_index=True)
    if train.empty:
        raise ValueError("no training triples left after data.heldout, data.caps and data.weights")
    train["relation_id"] = train["relation"].map({n: i for i, n in enumerate(names)}).astype(np.int64)
    heldout = pd.concat(heldout_parts, ignore_index=True)
    return TripleData(train=train, heldout=heldout, relations=names, counts=counts)


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
