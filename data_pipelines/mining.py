"""Hard-negative mining on Ray Data, with sentence-transformers' ``mine_hard_negatives`` rules and names: for (query,
positive) pairs and a corpus, the corpus is encoded once into a cached index (evaluation.corpus_index), each query's
first ``range_max`` corpus texts by exact search (or FAISS's lists: mining.search) are its candidates once its known
positives (every text paired with the same query) and the query itself are dropped. Against the query's lowest
positive score ``p`` a candidate is kept only at ``score <= p - absolute_margin`` and ``score <= p - |p| x
relative_margin`` (sign-safe), and within ``[min_score, max_score]``; the first ``range_min`` kept candidates are
skipped, then the hardest ``negatives_per_row`` are taken (``sampling: top``) or that many drawn at random
(``random``, seeded by the query). With labelled NLI pairs, a premise's hypotheses of the labels in
``labelled_negatives`` (e.g. contradiction) are negatives known from the data: they are in its group before any
mined one, the hardest up to ``negatives_per_row``, outside the margins, and mined ones fill the rest. Scores come
from the mining model, or from a teacher bi-encoder that re-scores the candidates, positives and labelled negatives
(the candidates are then ranked by its scores). Each query gives one query group ``{query,
positives, negatives}`` with the scores that kept them (``positive_scores``, ``negative_scores``).

Where raoe differs from sentence-transformers: the query's own text is never its negative; a group is kept with
fewer negatives than asked (sentence-transformers' n-tuples drop it); the candidates are the first ``range_max``
after the query's known positives, before any margin (sentence-transformers searches ``range_max`` + the dataset's
largest number of positives per query, and keeps ``range_max`` of them after the margins: its pool depends on the
other queries); with a teacher, those candidates are re-scored.

Each text is encoded once by each model: a known positive or labelled negative the corpus holds is scored from its
embedding in the index (found by a join on its id, its text checked), only the others are encoded. Where the queries
may find every corpus text (corpus rows <= queries x range_max), a teacher encodes the corpus once into an index of
the same rows (cached like the mining model's) and its scores of the candidates and known texts are read from it by
row, however many queries
find a text; a larger corpus is not encoded whole: each batch's teacher encodes the candidates its queries found.

Reading, encoding, searching and writing run in Ray Data; the driver only sees per-batch counts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipelines.corpus_cache import corpus_key
from data_pipelines.formats import group_table, has_nli_labels, keep_groups_with_negatives
from data_pipelines.readers import corpus_files, load_corpus
from data_pipelines.records import LABELS
from encoders.devices import EncoderPool, actor_device, pool_resources
from evaluation.corpus_index import CorpusIndex
from evaluation.figures import pyplot, save_figure
from storage.digests import content_digest, content_digests
from storage.paths import storage_path

HISTOGRAM_BINS = np.linspace(-1.0, 1.0, 41)
GROUP_COLUMNS = ("query", "positives", "negatives", "positive_scores", "negative_scores")  # what mining writes


@dataclass(frozen=True)
class MiningSettings:
    """What a mining actor needs; typed, so it crosses into Ray's actors as one object. The rules are
    sentence-transformers' ``mine_hard_negatives`` arguments of the same names (``negatives_per_row`` is its
    ``num_negatives``, ``sampling`` its ``sampling_strategy``)."""

    model_path: str
    index_path: str
    range_max: int = 50
    range_min: int = 0
    absolute_margin: float | None = None
    relative_margin: float | None = 0.05
    max_score: float | None = None
    min_score: float | None = None
    negatives_per_row: int = 1
    sampling: str = "top"
    seed: int = 42
    teacher_path: str | None = None
    batch_size: int = 64
    gpus: float = 0.0
    teacher_index_path: str | None = None  # the corpus encoded by the teacher, row for row (aligned_index)

    def allowed(self, scores: np.ndarray, lowest_positive: float) -> np.ndarray:
        """Which candidate scores pass the margins against the query's lowest positive and the score bounds."""
        keep = np.ones(len(scores), dtype=bool)
        if self.absolute_margin is not None:
            keep &= scores + self.absolute_margin <= lowest_positive
        if self.relative_margin is not None:
            keep &= scores <= lowest_positive - abs(lowest_positive) * self.relative_margin
        if self.max_score is not None:
            keep &= scores <= self.max_score
        if self.min_score is not None:
            keep &= scores >= self.min_score
        return keep

    def pick(self, ranked: list[int], scores: np.ndarray, query: str, count: int | None = None) -> list[int]:
        """``count`` negatives (default ``negatives_per_row``) among ``ranked`` (allowed candidates, hardest first),
        after skipping ``range_min``: the hardest, or that many at random (seeded by the query's text: any actor
        draws the same), hardest first."""
        count = self.negatives_per_row if count is None else count
        ranked = ranked[self.range_min:] if count > 0 else []
        if self.sampling == "top" or len(ranked) <= count:
            return ranked[:count]
        key = int.from_bytes(hashlib.sha1(query.encode("utf-8")).digest()[:8], "little")
        drawn = np.random.default_rng([self.seed, key]).choice(len(ranked), count, replace=False)
        return sorted((ranked[i] for i in drawn), key=lambda j: -scores[j])


def labelled_or_plain(path: str, fmt: str) -> str:
    """The corpus kind behind ``data.train``: NLI pairs with labels (only entailment pairs are (query, positive)
    pairs) or plain (query, positive) rows (the ``triplets`` kind, negative optional)."""
    if fmt in ("pairs_jsonl", "snli_jsonl", "senteval_nli", "csv"):
        return "pairs"
    if fmt == "triplets_jsonl" or str(path).startswith("hf:"):
        return "triplets"
    files, detected = corpus_files(path, "pairs", "auto")
    if detected == "senteval_nli":
        return "pairs"
    if files[0].suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return "pairs" if has_nli_labels(files[0]) else "triplets"
    return "pairs"


def is_beir_folder(path: str) -> bool:
    """A BEIR folder (queries.jsonl, qrels/, corpus.jsonl), local or on object storage."""
    root = storage_path(path) if not str(path).startswith("hf:") else None
    return root is not None and (root / "queries.jsonl").exists() and (root / "corpus.jsonl").exists()


JOIN_PAIRS_PER_PARTITION = 100_000


def shuffle_partitions(rows: int) -> int:
    """Partitions of a join or group-by over ``rows`` rows: ~100k rows each, up to Ray Data's shuffle width."""
    import ray

    return max(1, min(ray.data.DataContext.get_current().default_hash_shuffle_parallelism,
                      -(-rows // JOIN_PAIRS_PER_PARTITION)))


def beir_pairs(source: str, split: str):
    """(Ray Dataset of (query text, judged document text) for every qrels pair of ``split`` scored above 0,
    DataReport): the qrels' pairs joined with the corpus by Ray Data, so no document text reaches the driver (which
    holds the queries and qrels, as evaluation does); a document reads "title text", as the index holds it (so a
    query's judged documents are known positives, never its negatives)."""
    from collections import Counter

    import pyarrow as pa
    import ray

    from data_pipelines.readers import DataReport
    from evaluation.retrieval import read_task
    from evaluation.retrieval_suite import corpus_dataset

    task = read_task(source, split)
    rows = [{"text1": text, "id": doc} for query, text in zip(task.query_ids, task.query_texts)
            for doc, grade in task.qrels[query].items() if grade > 0]
    judged = sorted({row["id"] for row in rows})
    # The corpus filtered to the judged documents by the tasks that read it, before any shuffle: the join then moves
    # O(judged) rows, never the corpus.
    documents = corpus_dataset(source).map_batches(
        _judged_only, fn_kwargs={"ids": pa.array(judged, pa.string())}, batch_format="pyarrow",
    ).rename_columns({"text": "text2"}).materialize()
    held = Counter(row["id"] for row in documents.select_columns(["id"]).take_all())  # O(judged), as the qrels
    missing, repeated = sorted(set(judged) - set(held)), sorted(doc for doc, n in held.items() if n > 1)
    if missing:
        raise ValueError(f"{source}: qrels/{split} judge {len(missing)} document(s) its corpus lacks, e.g. "
                         f"{missing[:3]}")
    if repeated:
        raise ValueError(f"{source}: corpus.jsonl holds {len(repeated)} judged document id(s) more than once, e.g. "
                         f"{repeated[:3]}: which text is the positive is ambiguous; keep one line per _id")
    pairs = ray.data.from_items(rows).join(documents, join_type="inner", num_partitions=shuffle_partitions(len(rows)),
                                           on=("id",))
    found = len(rows)
    print(f"[raoe] {source}: {found} (query, judged document) pairs of {len(task.query_ids)} queries "
          f"(qrels/{split})", flush=True)
    return pairs.select_columns(["text1", "text2"]), DataReport(rows_in=found, rows_written=found, format="beir")


def _judged_only(table, ids):
    import pyarrow.compute as pc

    return table.filter(pc.is_in(table["id"], value_set=ids))


def query_positive_pairs(data_cfg, quarantine_path: Path, labelled_negatives: tuple[str, ...] = ()):
    """(Ray Dataset of text1, text2, is_negative rows, DataReport, the data's cache key); a BEIR folder gives its
    qrels' pairs. Labelled NLI pairs give their entailment pairs as (query, positive) and, for each label in
    ``labelled_negatives``, those pairs as (query, labelled negative) rows (is_negative true); the job refuses
    labelled_negatives for other data first (check_labelled_negatives)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if is_beir_folder(data_cfg.train):
        split = data_cfg.split or "train"
        ds, report = beir_pairs(data_cfg.train, split)
        key = "beir " + json.dumps(content_digests([storage_path(data_cfg.train) / name for name in
                                                    ("queries.jsonl", f"qrels/{split}.tsv")]))
        return ds.map_batches(_as_positives, batch_format="pyarrow"), report, key

    kind = labelled_or_plain(data_cfg.train, data_cfg.format)
    fmt = data_cfg.format if kind == "pairs" or data_cfg.format in ("triplets_jsonl", "parquet") else "auto"
    ds, report = load_corpus(kind, data_cfg.train, fmt=fmt, split=data_cfg.split, max_rows=data_cfg.max_rows,
                             shuffle_seed=data_cfg.shuffle_seed, on_bad_record=data_cfg.on_bad_record,
                             quarantine_path=quarantine_path)
    if kind != "pairs":
        return ds.map_batches(_as_positives, batch_format="pyarrow"), report, _data_key(data_cfg, kind, fmt)

    def positives_and_labelled(table):  # NLI: an entailment hypothesis is its premise's positive
        negative = pa.array([LABELS[name] for name in labelled_negatives], table["label"].type)
        table = table.filter(pc.or_(pc.equal(table["label"], LABELS["entailment"]),
                                    pc.is_in(table["label"], value_set=negative)))
        return pa.table({"text1": table["text1"], "text2": table["text2"],
                         "is_negative": pc.is_in(table["label"], value_set=negative)})

    return ds.map_batches(positives_and_labelled, batch_format="pyarrow"), report, _data_key(data_cfg, kind, fmt)


def _as_positives(table):
    """(query, positive) rows as mining's pairs: every text2 a positive."""
    import pyarrow as pa

    return pa.table({"text1": table["text1"], "text2": table["text2"],
                     "is_negative": pa.array(np.zeros(table.num_rows, dtype=bool))})


def check_labelled_negatives(data_cfg, labelled_negatives) -> None:
    """Refuse mining.labelled_negatives, by name, for data without NLI labels (before anything runs)."""
    if not labelled_negatives:
        return
    if is_beir_folder(data_cfg.train):
        what = "a BEIR folder, whose qrels judge no negative"
    elif labelled_or_plain(data_cfg.train, data_cfg.format) != "pairs":
        what = "(query, positive) rows without labels"
    else:
        return
    raise ValueError(f"mining.labelled_negatives {list(labelled_negatives)} needs labelled NLI pairs; "
                     f"data.train {data_cfg.train} is {what}")


def _data_key(data_cfg, kind: str, fmt: str) -> str:
    if str(data_cfg.train).startswith("hf:"):
        return json.dumps([data_cfg.train, data_cfg.split, data_cfg.max_rows, data_cfg.shuffle_seed])
    files, resolved = corpus_files(data_cfg.train, kind, fmt)
    return corpus_key(kind, files, resolved, split=data_cfg.split, max_rows=data_cfg.max_rows,
                      shuffle_seed=data_cfg.shuffle_seed)


def with_ids(table):
    """Rows of a corpus get an id from their text (the same text, the same id)."""
    import pyarrow as pa

    texts = table["text"].to_pylist()
    return pa.table({"id": [text_id(t) for t in texts], "text": texts})


def mining_corpus(pairs, corpus_path: str | None, corpus_fmt: str, data_key: str):
    """(Ray Dataset of distinct (id, text), cache key): ``mining.corpus`` (sentences: txt or JSON lines with text, or
    a BEIR folder), or the pairs' positives."""
    if corpus_path is None:
        texts = pairs.map_batches(_positive_rows, batch_format="pyarrow").select_columns(["text2"])
        texts = texts.rename_columns({"text2": "text"})
        key = "positives of " + data_key
    elif (storage_path(corpus_path) / "corpus.jsonl").exists():  # a BEIR folder, local or on object storage
        from evaluation.retrieval_suite import corpus_dataset

        texts = corpus_dataset(corpus_path).select_columns(["text"])
        key = "beir " + content_digest(storage_path(corpus_path) / "corpus.jsonl")
    else:
        texts, _ = load_corpus("sentences", corpus_path, fmt=corpus_fmt)
        files, resolved = corpus_files(corpus_path, "sentences", corpus_fmt)
        texts, key = texts.select_columns(["text"]), "sentences " + corpus_key("sentences", files, resolved)
    distinct = texts.groupby("text").count().select_columns(["text"])
    return distinct.map_batches(with_ids, batch_format="pyarrow"), key


def _positive_rows(table):
    """The pairs that are (query, positive), not (query, labelled negative)."""
    import pyarrow.compute as pc

    return table.filter(pc.invert(table["is_negative"]))


def positives_by_query(pairs, partitions: int = 1):
    """One row per distinct query of ``located_positives``' pairs, with every positive it has (the known positives
    mining must not return) and each one's row in the corpus index (-1 where the index lacks it), and the same for
    its labelled negatives. The pairs are hash-partitioned by query into ``partitions`` groups, each grouped by
    Arrow in one call: Ray Data's per-query grouping (``map_groups`` by query, or its list aggregations) pays a
    Python call per query, 75 s of 100,000 here, this 6 s."""
    keyed = pairs.map_batches(_with_query_partition, fn_kwargs={"partitions": partitions}, batch_format="pyarrow")
    grouped = keyed.groupby("query_partition", num_partitions=partitions).map_groups(_grouped_by_query,
                                                                                      batch_format="pyarrow")
    return grouped.map_batches(_known_texts_by_query, batch_format="numpy")


def _with_query_partition(table, partitions: int):
    import pyarrow as pa

    numbers = [zlib.crc32(text.encode("utf-8")) % partitions for text in table["text1"].to_pylist()]
    return table.append_column("query_partition", pa.array(numbers, pa.int64()))


def _grouped_by_query(table):
    """A partition's pairs as one row per query, its texts (positives and labelled negatives), their rows and which
    are negatives listed side by side (one pass in input order: the lists align)."""
    import pyarrow as pa

    grouped = table.group_by("text1", use_threads=False).aggregate([("text2", "list"), ("positive_row", "list"),
                                                                    ("is_negative", "list")])
    return pa.table({"text1": grouped["text1"], "texts": grouped["text2_list"], "rows": grouped["positive_row_list"],
                     "is_negative": grouped["is_negative_list"]})


def _known_texts_by_query(batch: dict[str, np.ndarray]):
    """Each query's positives once each, sorted, with their rows (the lists are aggregated side by side), and its
    labelled negatives the same way (a text that is also its positive is a positive; the query's own text is never
    its negative); a query with labelled negatives only is left out: it has nothing to mine against."""
    import pyarrow as pa

    columns = {name: [] for name in ("text1", "positives", "positive_rows", "labelled_negatives", "labelled_rows")}
    for query, texts, at, negative in zip(batch["text1"], batch["texts"], batch["rows"], batch["is_negative"]):
        positive_row = {str(t): int(r) for t, r, n in zip(texts, at, negative) if not n}
        if not positive_row:
            continue
        labelled_row = {str(t): int(r) for t, r, n in zip(texts, at, negative)
                        if n and str(t) not in positive_row and str(t) != str(query)}
        columns["text1"].append(query)
        for texts_key, rows_key, row_of in (("positives", "positive_rows", positive_row),
                                            ("labelled_negatives", "labelled_rows", labelled_row)):
            ordered = sorted(row_of)
            columns[texts_key].append(ordered)
            columns[rows_key].append([row_of[t] for t in ordered])
    texts, rows = pa.list_(pa.large_string()), pa.list_(pa.int64())
    return pa.table(columns, schema=pa.schema([("text1", pa.large_string()), ("positives", texts),
                                               ("positive_rows", rows), ("labelled_negatives", texts),
                                               ("labelled_rows", rows)]))


def text_id(text: str) -> str:
    """A corpus text's id in a mining index (with_ids): the same text, the same id."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def located_positives(pairs, index: CorpusIndex, pairs_count: int | None = None):
    """The pairs, each positive (or labelled negative: ``is_negative``) with its row in the index (``positive_row``,
    -1 where the corpus lacks it), by a hash join of the texts' ids with the index's (id, row) table in Ray Data
    (nothing reaches the driver): a text the index holds is scored from its stored embedding, never encoded again
    (with the pairs' own positives as the corpus, no positive is)."""

    from evaluation.corpus_index import row_ids

    keyed = pairs.map_batches(_with_positive_ids, batch_format="pyarrow")
    partitions = shuffle_partitions(max(index.rows, pairs_count or 0))
    joined = keyed.join(row_ids(index), join_type="left_outer", num_partitions=partitions, on=("positive_id",),
                        right_on=("id",))
    return joined.map_batches(_row_or_missing, batch_format="pyarrow")


def _with_positive_ids(table):
    import pyarrow as pa

    return pa.table({"text1": table["text1"], "text2": table["text2"], "is_negative": table["is_negative"],
                     "positive_id": pa.array([text_id(t) for t in table["text2"].to_pylist()], pa.string())})


def _row_or_missing(table):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pa.table({"text1": table["text1"], "text2": table["text2"], "is_negative": table["is_negative"],
                     "positive_row": pc.fill_null(table["row"], -1).cast(pa.int64())})


def _unit_embeddings(model, texts: list[str], batch_size: int, side: str) -> np.ndarray:
    """Unit embeddings of queries or documents, each with its own prompt and length (model.prompts)."""
    from encoders.backbone import inference_embeddings
    from evaluation.search import normalised

    return normalised(inference_embeddings(model, texts, batch_size, side))


def _distinct_rows(rows_of) -> np.ndarray:
    """The distinct index rows (>= 0: -1 marks a text the index lacks) among a batch's lists of rows, sorted."""
    rows = [np.asarray(r, dtype=np.int64) for r in rows_of]
    return np.unique(np.concatenate([r[r >= 0] for r in rows] + [np.zeros(0, np.int64)]))


def held_rows(index: CorpusIndex, positives: list[list[str]], rows: list[np.ndarray]) -> list[np.ndarray]:
    """``rows`` with -1 wherever the index's text at a row is not the positive's (ids are 64-bit text hashes: a
    collision must not score a positive by another text's embedding); one read of the batch's distinct rows."""
    stored = _distinct_rows(rows)
    text_of = dict(zip(stored.tolist(), index.take("text", stored)))
    return [np.array([r if r >= 0 and text_of[int(r)] == p else -1 for p, r in zip(known, at)], dtype=np.int64)
            for known, at in zip(positives, rows)]


def _scores_of_positives(model, index: CorpusIndex | None, q_emb: np.ndarray, positives: list[list[str]],
                         rows: list[np.ndarray], batch_size: int) -> tuple[list[np.ndarray], int]:
    """(Each query's score with each of its known positives, how many texts were encoded for them): a positive the
    index holds (its row >= 0) is read from it, every other distinct positive of the batch encoded once (all of
    them without an index)."""
    rows = rows if index is not None else [np.full(len(known), -1, dtype=np.int64) for known in positives]
    stored = _distinct_rows(rows)
    documents = list(dict.fromkeys(p for known, at in zip(positives, rows) for p, r in zip(known, at) if r < 0))
    emb_of_row = dict(zip(stored.tolist(), index.embeddings(stored))) if len(stored) else {}
    emb_of_text = dict(zip(documents, _unit_embeddings(model, documents, batch_size, "document"))) if documents else {}
    scores = [np.array([(emb_of_row[int(r)] if r >= 0 else emb_of_text[p]) @ q_emb[i] for p, r in zip(known, at)],
                       dtype=np.float32) for i, (known, at) in enumerate(zip(positives, rows))]
    return scores, len(documents)


class QueryEncoder:
    """Phase 1, a Ray Data actor: each query's unit embedding and, without a teacher (who scores them in phase 3),
    its scores with its known positives and its labelled negatives by the mining model (loaded once per actor), from
    the index's stored embeddings where it holds them."""

    def __init__(self, settings: MiningSettings):
        from encoders.backbone import load_encoder

        self.s = settings
        self.model = load_encoder(settings.model_path, device=actor_device(settings.gpus))
        self.index = CorpusIndex.at(settings.index_path) if not settings.teacher_path else None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        queries = [str(q) for q in batch["text1"]]
        q_emb = _unit_embeddings(self.model, queries, self.s.batch_size, "query")
        scores, labelled_scores = np.empty(len(queries), dtype=object), np.empty(len(queries), dtype=object)
        encoded = [0, 0]
        if self.index is None:  # the teacher's scores replace them
            scores[:] = labelled_scores[:] = [np.zeros(0, dtype=np.float32)] * len(queries)
        else:
            (of_positives, of_labelled), encoded = _scores_of_known(self.model, self.index, q_emb, batch,
                                                                    self.s.batch_size)
            scores[:], labelled_scores[:] = of_positives, of_labelled
        counted = np.zeros((len(queries), 2), dtype=np.int64)
        counted[:1] = encoded  # the batch's counts (positives, labelled negatives), on its first row
        return {"text1": batch["text1"], "query_embedding": q_emb, "positive_scores": scores,
                "labelled_scores": labelled_scores, "known_encoded": counted, **_known_columns(batch)}


def _listed(texts_of: np.ndarray) -> list[list[str]]:
    """A numpy batch's column of text lists (each an object ndarray) as Python lists: Ray Data cannot write an
    object ndarray of object ndarrays back to Arrow and would pickle the column."""
    return [list(texts) for texts in texts_of]


KNOWN_COLUMNS = ("positives", "positive_rows", "labelled_negatives", "labelled_rows")


def _known_columns(batch: dict[str, np.ndarray]) -> dict[str, list]:
    """A batch's known positives and labelled negatives with their index rows, passed on to the next phase."""
    return {name: _listed(batch[name]) if name in ("positives", "labelled_negatives") else batch[name]
            for name in KNOWN_COLUMNS}


def _scores_of_known(model, index: CorpusIndex | None, q_emb: np.ndarray, batch: dict[str, np.ndarray],
                     batch_size: int, checked_by: CorpusIndex | None = None) -> tuple[tuple[list, list], list[int]]:
    """((each query's scores with its known positives, with its labelled negatives), [positives, labelled negatives
    encoded]): scored together as _scores_of_positives scores positives (each text the index lacks encoded once for
    the batch, whichever kind it is for which query); the rows are checked against the texts of ``checked_by``
    (default ``index``: a teacher's aligned index holds none)."""
    positives = [list(p) for p in batch["positives"]]
    labelled = [list(n) for n in batch["labelled_negatives"]]
    texts = [p + n for p, n in zip(positives, labelled)]
    rows = [np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(n, dtype=np.int64)])
            for p, n in zip(batch["positive_rows"], batch["labelled_rows"])]
    rows = held_rows(checked_by or index, texts, rows) if index is not None else \
        [np.full(len(t), -1, dtype=np.int64) for t in texts]
    scores, _ = _scores_of_positives(model, index, q_emb, texts, rows, batch_size)
    encoded_positives = {t for known, at in zip(positives, rows) for t, r in zip(known, at) if r < 0}
    encoded_labelled = {t for known, given, at in zip(positives, labelled, rows)
                        for t, r in zip(given, at[len(known):]) if r < 0} - encoded_positives
    split = ([s[: len(p)] for s, p in zip(scores, positives)], [s[len(p):] for s, p in zip(scores, positives)])
    return split, [len(encoded_positives), len(encoded_labelled)]


def _search_candidates(batch: dict[str, np.ndarray], actors: list, rows: int, range_max: int, method,
                       negatives_per_row: int) -> dict[str, np.ndarray]:
    """Phase 2, a Ray Data task holding no CPU: each query's first ``range_max`` + (its batch's most known texts + 1)
    index rows found by the search actors (by their method: exact, or FAISS's lists), room for its known positives,
    its labelled negatives and the query itself to be left out. A query whose labelled negatives fill its group
    (``negatives_per_row``) is not searched: nothing would be mined for it."""
    from evaluation.search_actors import SearchActors

    known = [len(p) + len(n) for p, n in zip(batch["positives"], batch["labelled_negatives"])]
    searched = [i for i, n in enumerate(batch["labelled_negatives"]) if len(n) < negatives_per_row]
    candidate_rows = [np.zeros(0, np.int64) for _ in known]
    candidate_scores = [np.zeros(0, np.float32) for _ in known]
    if searched:
        widest = max(known[i] for i in searched) + 1
        scores, found = SearchActors(actors, rows, method).search(batch["query_embedding"][searched], range_max + widest)
        for i, values, at in zip(searched, scores, found):
            candidate_rows[i], candidate_scores[i] = at[at >= 0], values[at >= 0]
    return {"text1": batch["text1"], "positive_scores": batch["positive_scores"],
            "labelled_scores": batch["labelled_scores"], "known_encoded": batch["known_encoded"],
            "candidate_rows": _column(candidate_rows), "candidate_scores": _column(candidate_scores),
            **_known_columns(batch)}


def _column(arrays: list[np.ndarray]) -> np.ndarray:
    """A list of arrays as one object array of them (numpy would stack arrays of one length into a matrix)."""
    return np.array(list(arrays) + [None], dtype=object)[:-1]


class NegativeMiner:
    """Phase 3, a Ray Data actor: the candidates' texts looked up in the index, the known positives, the labelled
    negatives and the query left out, the margins and bounds applied against the query's lowest positive, the
    negatives picked after the query's labelled ones (which no margin, bound or range_min touches); with a
    teacher (loaded once per actor, to encode the queries) the known texts and candidates re-scored by it first, from
    the teacher's index of the corpus (aligned_index: the same rows)."""

    def __init__(self, settings: MiningSettings):
        from encoders.backbone import load_encoder

        self.s = settings
        self.teacher = load_encoder(settings.teacher_path, device=actor_device(settings.gpus)) \
            if settings.teacher_path else None
        self.index = CorpusIndex.at(settings.index_path)  # texts looked up per batch, never held whole; on object
        # storage from this node's copy of its id and text columns, made once per node
        self.teacher_index = CorpusIndex.at(settings.teacher_index_path) if settings.teacher_index_path else None

    def __call__(self, batch: dict[str, np.ndarray]):
        """A group per query of a batch (each with every known positive), then one row without a negative carrying
        the batch's counts."""
        queries = [str(q) for q in batch["text1"]]
        positives = [list(p) for p in batch["positives"]]
        labelled = [list(n) for n in batch["labelled_negatives"]]
        found_of = self._candidates(queries, positives, labelled, batch["candidate_rows"], batch["candidate_scores"])
        pos_scores_of, labelled_scores_of = list(batch["positive_scores"]), list(batch["labelled_scores"])
        cand_scores_of = [np.asarray([score for _, score, _ in found], dtype=np.float32) for found in found_of]
        encoded = np.asarray(batch["known_encoded"], dtype=np.int64).reshape(-1, 2).sum(axis=0)
        if self.teacher is not None:
            (pos_scores_of, labelled_scores_of), cand_scores_of, by_teacher = self._teacher_scores(queries, batch,
                                                                                                 found_of)
            encoded += by_teacher
        out = {k: [] for k in GROUP_COLUMNS + ("batch_stats",)}
        stats = {"queries": 0, "pairs": 0, "without_negative": 0, "dropped_by_margin": 0,
                 "positives_encoded": int(encoded[0]), "labelled_encoded": int(encoded[1]), "labelled_negatives": 0}
        for query, known, given, found, pos_scores, given_scores, cand_scores in zip(
                queries, positives, labelled, found_of, pos_scores_of, labelled_scores_of, cand_scores_of):
            candidates = [t for t, _, _ in found]
            allowed = self.s.allowed(cand_scores, float(np.min(pos_scores)))
            ranked = [int(j) for j in np.argsort(-cand_scores, kind="stable") if allowed[j]]
            given_kept = [int(j) for j in np.argsort(-np.asarray(given_scores), kind="stable")][
                : self.s.negatives_per_row]
            kept = self.s.pick(ranked, cand_scores, query, self.s.negatives_per_row - len(given_kept))
            negatives = sorted([(given[j], float(given_scores[j])) for j in given_kept] +
                               [(candidates[j], float(cand_scores[j])) for j in kept], key=lambda n: -n[1])
            stats["queries"] += 1
            stats["pairs"] += len(known)
            stats["dropped_by_margin"] += len(candidates) - len(ranked)
            stats["without_negative"] += not negatives
            stats["labelled_negatives"] += len(given_kept)
            for key, value in (("query", query), ("positives", known), ("negatives", [t for t, _ in negatives]),
                               ("positive_scores", [float(p) for p in pos_scores]),
                               ("negative_scores", [score for _, score in negatives]), ("batch_stats", "")):
                out[key].append(value)
        for key, value in (("query", ""), ("positives", []), ("negatives", []), ("positive_scores", []),
                           ("negative_scores", []), ("batch_stats", json.dumps(stats))):
            out[key].append(value)
        return group_table(out)

    def _candidates(self, queries: list[str], positives: list[list[str]], labelled: list[list[str]], rows_of,
                    scores_of):
        """Each query's first range_max (text, score, index row) found, its known positives, its labelled negatives
        (its group holds them already) and itself left out."""
        distinct = _distinct_rows(rows_of)
        text_of = dict(zip(distinct.tolist(), self.index.take("text", distinct)))
        found_of = []
        for query, known, given, rows, scores in zip(queries, positives, labelled, rows_of, scores_of):
            excluded = set(known) | set(given) | {query}
            found = [(text_of[int(r)], float(s), int(r)) for r, s in zip(rows, scores)
                     if text_of[int(r)] not in excluded]
            found_of.append(found[: self.s.range_max])
        return found_of

    def _teacher_scores(self, queries: list[str], batch: dict[str, np.ndarray], found_of):
        """((The teacher's scores of each query's positives, of its labelled negatives), of its candidates, [positives,
        labelled negatives] it encoded): the queries encoded; with the teacher's index (aligned_index), every candidate and
        every known text the corpus holds read from it by row (rows checked against the mining index's texts), the
        others encoded once for the batch; without (a corpus larger than the queries can find), the batch's
        distinct candidates and known texts encoded."""
        q_emb = _unit_embeddings(self.teacher, queries, self.s.batch_size, "query")
        known_scores, encoded = _scores_of_known(self.teacher, self.teacher_index, q_emb, batch, self.s.batch_size,
                                                 checked_by=self.index)
        if self.teacher_index is not None:  # each candidate by its row in the teacher's index
            keys_of, lookup = [[r for _, _, r in found] for found in found_of], self.teacher_index.embeddings
        else:  # each distinct candidate text of the batch encoded
            keys_of = [[t for t, _, _ in found] for found in found_of]
            lookup = lambda texts: _unit_embeddings(self.teacher, texts, self.s.batch_size, "document")  # noqa: E731
        distinct = list(dict.fromkeys(k for keys in keys_of for k in keys))
        stored, at = (lookup(distinct) if distinct else None), {key: k for k, key in enumerate(distinct)}
        candidate_scores = [stored[[at[k] for k in keys]] @ q_emb[i] if keys else np.zeros(0, np.float32)
                            for i, keys in enumerate(keys_of)]
        return known_scores, candidate_scores, encoded


def mine(pairs, index: CorpusIndex, settings: MiningSettings, pool: EncoderPool, queries_per_batch: int = 256,
         method=None, pairs_count: int | None = None):
    """(The mined rows (with their scores and each batch's counts), materialised in the object store; the search's
    recall@range_max against exact search when ``method`` is approximate, else None), in three phases that each
    hold the pool's resources alone (materialised in turn: no phase waits on CPUs another holds): the queries
    encoded by the encoder actors, their candidates found by the search actors that hold the index between them
    (evaluation.search_actors, searching by ``method``: exact by default), the negatives picked by the mining
    tasks."""
    import ray

    from evaluation.corpus_index import aligned_index
    from evaluation.search_actors import SearchMethod, search_actors

    method = method or SearchMethod()
    actors = ray.data.ActorPoolStrategy(size=pool.actors)
    resources = pool_resources(pool.cpus_per_actor, pool.gpus_per_actor)
    groups = positives_by_query(located_positives(pairs, index, pairs_count),
                                shuffle_partitions(pairs_count or 0)).materialize()  # tasks done before the
    # actors take the CPUs; each positive the corpus holds is scored from the index (the teacher's, with one)
    if settings.teacher_path and index.rows <= groups.count() * settings.range_max:
        # the queries may find every corpus text: the teacher encodes the corpus once, row for row, and its scores
        # are read by row (a corpus larger than that: each batch encodes the candidates its queries found)
        teacher_index = aligned_index(index, settings.teacher_path, pool=pool, batch_size=settings.batch_size)
        settings = dataclasses.replace(settings, teacher_index_path=teacher_index.location)
    calls, _ = in_encoder_calls(groups, queries_per_batch, pool.actors)
    encoded = calls.map_batches(QueryEncoder, fn_constructor_kwargs={"settings": settings}, batch_size=None,
                                compute=actors, **resources).materialize()  # a block a call (in_encoder_calls)
    recall, sample = None, []
    if method.approximate and method.recall_queries:  # read before the search actors take the CPUs
        sample = [row["query_embedding"] for row in encoded.take(method.recall_queries)]
    with search_actors(index, pool, method) as searcher:
        found = encoded.map_batches(
            _search_candidates, fn_kwargs={"actors": searcher.actors, "rows": index.rows,
                                           "range_max": settings.range_max, "method": method,
                                           "negatives_per_row": settings.negatives_per_row},
            batch_size=None, num_cpus=0, concurrency=len(searcher.actors)).materialize()  # an encoder call's
        # block a search: each search is a round of actor calls (512-query batches made the search 1.5x longer), and
        # the picking phase gets the same blocks
        if sample:
            recall = searcher.recall(np.stack(sample), settings.range_max)
            print(f"[raoe] approximate search (faiss): recall@{settings.range_max} {recall:.4f} against exact search "
                  f"over {len(sample)} queries", flush=True)
    if settings.teacher_path:  # a model to hold: actors that load it once
        mined = found.map_batches(NegativeMiner, fn_constructor_kwargs={"settings": settings},
                                  batch_size=queries_per_batch, compute=actors, **resources).materialize()
    else:  # no model: tasks (pooled processes)
        mined = found.map_batches(_pick_negatives, fn_kwargs={"settings": settings}, batch_size=queries_per_batch,
                                  num_cpus=pool.cpus_per_actor).materialize()
    return mined, recall


ENCODE_ROWS = 4096  # queries an encoder actor sorts by length at once: 512 pad MiniLM's SNLI-like queries by 33%


def encoder_rows(queries: int, queries_per_batch: int, actors: int) -> int:
    """Queries per call of an encoder actor: up to ENCODE_ROWS (it sorts a call's texts by length, so larger calls
    pad less: 1.33x the real tokens in calls of 512 queries, 1.05x in 4096, measured on 100,000 synthetic SNLI
    queries), at least ``queries_per_batch``, and small enough that every actor gets about four calls."""
    return max(queries_per_batch, min(ENCODE_ROWS, -(-queries // (4 * max(1, actors)))))


def in_encoder_calls(groups, queries_per_batch: int, actors: int):
    """(The grouped queries in blocks of one encoder call each, materialised, the most rows a block holds): a
    group-by's output is one block per partition (one of 100,000 queries here), and an actor pool hands out blocks:
    without the split one actor encodes every query while the others wait. Split before the actors start: a split
    task waiting for a CPU the actors hold would wait forever. The split's blocks differ by a row at most, none over
    the call's rows: map them with ``batch_size=None`` (a block a call); with the call's rows as the batch size, Ray
    Data glues a shorter block to the next (100,000 queries: 12 calls of about 8,000 and one of 4,000, not 25)."""
    queries = groups.count()
    rows = encoder_rows(queries, queries_per_batch, actors)
    return groups.repartition(max(1, -(-queries // rows))).materialize(), rows


def _pick_negatives(batch: dict[str, np.ndarray], settings: MiningSettings):
    """Phase 3 without a teacher: a task; its process's miner (the index opened once) reused by later tasks."""
    if settings not in _MINERS:
        _MINERS[settings] = NegativeMiner(settings)
    return _MINERS[settings](batch)


_MINERS: dict[MiningSettings, "NegativeMiner"] = {}


def mining_report(mined) -> dict:
    """Counts and score histograms, reduced batch by batch (a row per batch reaches the driver)."""
    import pyarrow as pa

    def reduce(table):
        stats = [json.loads(s) for s in table["batch_stats"].to_pylist() if s]
        written = keep_groups_with_negatives(table)
        flat = lambda name: pa.compute.list_flatten(written[name]).to_numpy(zero_copy_only=False)  # noqa: E731
        return pa.table({"queries": [sum(s["queries"] for s in stats)], "pairs": [sum(s["pairs"] for s in stats)],
                         "without_negative": [sum(s["without_negative"] for s in stats)],
                         "dropped_by_margin": [sum(s["dropped_by_margin"] for s in stats)],
                         "positives_encoded": [sum(s["positives_encoded"] for s in stats)],
                         "labelled": [sum(s["labelled_negatives"] for s in stats)],
                         "labelled_encoded": [sum(s["labelled_encoded"] for s in stats)],
                         "written": [written.num_rows], "negatives": [len(flat("negatives"))],
                         "pos": [np.histogram(flat("positive_scores"), HISTOGRAM_BINS)[0].tolist()],
                         "neg": [np.histogram(flat("negative_scores"), HISTOGRAM_BINS)[0].tolist()]})

    parts = mined.map_batches(reduce, batch_format="pyarrow", batch_size=None).take_all()
    return {"pairs_in": sum(int(p["pairs"]) for p in parts), "queries_in": sum(int(p["queries"]) for p in parts),
            "rows_written": sum(int(p["written"]) for p in parts),
            "negatives_written": sum(int(p["negatives"]) for p in parts),
            "rows_without_negative": sum(int(p["without_negative"]) for p in parts),
            "candidates_dropped_by_margin": sum(int(p["dropped_by_margin"]) for p in parts),
            "positives_encoded": sum(int(p["positives_encoded"]) for p in parts),
            "labelled_negatives_written": sum(int(p["labelled"]) for p in parts),
            "labelled_negatives_encoded": sum(int(p["labelled_encoded"]) for p in parts),
            "histogram": {"bins": HISTOGRAM_BINS.tolist(),
                          "positive": np.sum([p["pos"] for p in parts], axis=0).astype(int).tolist(),
                          "negative": np.sum([p["neg"] for p in parts], axis=0).astype(int).tolist()}}


def write_mined(mined, output_path: str) -> None:
    """The groups that kept a negative, as JSON lines {query, positives, negatives, positive_scores,
    negative_scores} (a folder of files; Stage 1 trains them with data.format groups_jsonl)."""
    rows = mined.map_batches(lambda t: keep_groups_with_negatives(t).select(list(GROUP_COLUMNS)),
                             batch_format="pyarrow")
    rows.write_json(output_path)


def plot_scores(histogram: dict, path: str | Path, title: str) -> Path:
    """Positive against kept-negative scores: the margin shows as the gap between the two."""
    plt = pyplot()

    bins = np.asarray(histogram["bins"])
    centres, width = (bins[:-1] + bins[1:]) / 2, bins[1] - bins[0]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.bar(centres, histogram["positive"], width=width, alpha=0.6, label="positive")
    ax.bar(centres, histogram["negative"], width=width, alpha=0.6, label="kept negative (mined or labelled)")
    ax.set_xlabel("score (cosine)")
    ax.set_ylabel("rows")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)
