"""Retrieval tasks in the BEIR layout and their metrics, as BEIR's ``EvaluateRetrieval`` reports them (pytrec_eval's
definitions): nDCG@10 with graded gains, MRR@10, Recall@10, Recall@100 and MAP@100, each a mean over every judged
query, as fractions in [0, 1]. BEIR's conventions, each tested against the ``beir`` package and pytrec_eval:
- a document whose id is the query's id is not a hit (``ignore_identical_ids``, on by default as in BEIR: ArguAna
  and Quora hold each query in the corpus);
- a document id the corpus holds twice counts once, at its best score (raoe's rule: BEIR reads the corpus into a
  dict, keeping one text per id, so it never ranks an id twice);
- a query whose judgements are all 0 counts, with every metric 0;
- documents of equal score rank by document id, the higher id first (trec_eval's order).

A BEIR folder holds ``corpus.jsonl`` ({_id, title, text}), ``queries.jsonl`` ({_id, text}) and
``qrels/<split>.tsv`` (query-id, corpus-id, score; a header line; score > 0 is relevant). ``hf:<dataset>`` reads
the same three parts from a Hugging Face dataset in the NanoBEIR / MTEB layout (configs ``corpus``, ``queries`` and
``qrels`` or ``default``) when a hub is reachable."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evaluation.figures import pyplot, save_figure
from storage.paths import storage_path

METRICS = ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100")
DEPTH = 100  # documents ranked per query: the deepest cut of METRICS
# Documents searched per query: DEPTH and room for what the ranking drops (the query's own id, an id held twice) and
# for ties at the cut, which rank by document id only once all of them are in.
SEARCH_DEPTH = DEPTH + 10
HUB_PREFIX = "hf:"


class BeirFormatError(ValueError):
    """A BEIR file that cannot be read; the message names the file and line."""


@dataclass
class RetrievalTask:
    """The queries and relevance judgements of one task; the corpus is read separately (it may be large)."""

    name: str
    source: str
    query_ids: list[str]
    query_texts: list[str]
    qrels: dict[str, dict[str, int]]  # query id -> {corpus id: relevance >= 0}; a query judged only 0 counts as 0
    ignore_identical_ids: bool = True  # BEIR's default: a document with the query's id is never a hit


def corpus_text(record: dict) -> str:
    """A BEIR document as the evaluators embed it: title and text joined by a space (either may be empty)."""
    return f"{record.get('title') or ''} {record.get('text') or ''}".strip()


def _jsonl(path, required: tuple[str, ...]):
    if not path.exists():
        raise BeirFormatError(f"{path}: missing (a BEIR folder holds corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BeirFormatError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            missing = [k for k in required if k not in record]
            if missing:
                raise BeirFormatError(f"{path}:{line_no}: missing field(s) {missing}")
            yield record


def read_qrels(path) -> dict[str, dict[str, int]]:
    """``query-id, corpus-id, score`` rows (tab-separated, header line optional); score > 0 is relevant, and a query
    judged only 0 (or below, read as 0) is kept: BEIR scores it 0."""
    path = storage_path(path)
    if not path.exists():
        raise BeirFormatError(f"{path}: missing qrels file (qrels/<split>.tsv)")
    qrels: dict[str, dict[str, int]] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            parts = line.rstrip("\n").split("\t")
            if not line.strip() or (line_no == 1 and parts[0] == "query-id"):
                continue
            if len(parts) < 3:
                raise BeirFormatError(f"{path}:{line_no}: expected query-id, corpus-id, score (tab-separated)")
            try:
                score = int(float(parts[2]))
            except ValueError:
                raise BeirFormatError(f"{path}:{line_no}: score {parts[2]!r} is not a number") from None
            qrels.setdefault(parts[0], {})[parts[1]] = max(score, 0)
    return qrels


def read_task(source: str, split: str = "test", name: str | None = None, max_queries: int | None = None,
              ignore_identical_ids: bool = True) -> RetrievalTask:
    """Queries (those with judgements, in file order, the first ``max_queries``) and qrels of a task."""
    if source.startswith(HUB_PREFIX):
        queries, qrels = _hub_queries_qrels(source.removeprefix(HUB_PREFIX), split)
    else:
        root = storage_path(source)  # a local folder or one on object storage
        if not (root / "qrels" / f"{split}.tsv").exists():
            splits = sorted(p.stem for p in (root / "qrels").glob("*.tsv")) if (root / "qrels").exists() else []
            raise BeirFormatError(f"{source}: no qrels/{split}.tsv (split {split!r}); its splits: {splits}")
        qrels = read_qrels(root / "qrels" / f"{split}.tsv")
        queries = {str(r["_id"]): str(r["text"]) for r in _jsonl(root / "queries.jsonl", ("_id", "text"))}
    unknown = sorted(set(qrels) - set(queries))
    if unknown:
        raise BeirFormatError(f"{source}: qrels/{split} names {len(unknown)} query id(s) absent from the queries, "
                              f"e.g. {unknown[:3]}")
    ids = [q for q in queries if q in qrels][:max_queries]
    return RetrievalTask(name or task_name(source), source, ids, [queries[q] for q in ids],
                         {q: qrels[q] for q in ids}, ignore_identical_ids)


def task_name(source: str) -> str:
    return source.removeprefix(HUB_PREFIX).rstrip("/").split("/")[-1]


def read_corpus(source: str):
    """(id, text) of every document, streamed from ``corpus.jsonl`` (or the hub's ``corpus`` config)."""
    if source.startswith(HUB_PREFIX):
        for r in hub_part(source.removeprefix(HUB_PREFIX), "corpus"):
            yield str(r["_id"]), corpus_text(r)
        return
    for r in _jsonl(storage_path(source) / "corpus.jsonl", ("_id", "text")):
        yield str(r["_id"]), corpus_text(r)


DEV_MAX_DOCUMENTS = 200_000


@dataclass
class RetrievalDevSet:
    """A retrieval task scored inside training (checkpoint selection): its queries, judgements and whole corpus,
    read once on the driver and handed to the workers, which may not see the files."""

    task: RetrievalTask
    corpus_ids: list[str]
    corpus_texts: list[str]


def read_dev_set(source: str, split: str = "dev", name: str | None = None, max_queries: int | None = None,
                 max_documents: int = DEV_MAX_DOCUMENTS, ignore_identical_ids: bool = True,
                 key: str = "eval.dev_retrieval") -> RetrievalDevSet:
    task = read_task(source, split, name, max_queries, ignore_identical_ids)
    ids, texts = [], []
    for doc_id, text in read_corpus(source):
        if len(ids) == max_documents:
            raise ValueError(f"{key}: {source} holds more than {max_documents:,} documents; each check encodes the "
                             "whole corpus: use a dev-sized set")
        ids.append(doc_id)
        texts.append(text)
    return RetrievalDevSet(task, ids, texts)


def dev_ndcg_at_10(encode, dev: RetrievalDevSet) -> float:
    """nDCG@10 x 100 of ``encode`` ((texts, side) -> embeddings: queries on the query side, documents on the
    document side) on a dev set, by the evaluation suite's exact search and metric."""
    from evaluation.search import exact_top_k, normalised

    corpus = normalised(encode(dev.corpus_texts, "document"))
    queries = normalised(encode(dev.task.query_texts, "query"))
    scores, rows = exact_top_k(queries, corpus, SEARCH_DEPTH)
    ranked = rankings(dev.task, scores, rows, lambda found: [dev.corpus_ids[r] for r in found])
    return 100 * score_rankings(dev.task, ranked)[0]["ndcg@10"]


def hub_part(dataset: str, config: str):
    from datasets import load_dataset

    parts = load_dataset(dataset, config)
    return parts[next(iter(parts))]


def _hub_queries_qrels(dataset: str, split: str):
    from datasets import load_dataset

    queries = {str(r["_id"]): str(r["text"]) for r in hub_part(dataset, "queries")}
    try:
        parts = load_dataset(dataset, "qrels")  # NanoBEIR
    except ValueError:
        parts = load_dataset(dataset, "default")  # MTEB
    if split not in parts:
        raise BeirFormatError(f"hf:{dataset}: no qrels split {split!r}; its splits: {sorted(parts)}")
    rows = parts[split]
    qrels: dict[str, dict[str, int]] = {}
    for r in rows:
        qid = str(r.get("query-id", r.get("query_id")))
        did = str(r.get("corpus-id", r.get("corpus_id")))
        qrels.setdefault(qid, {})[did] = max(int(r.get("score", 1)), 0)
    return queries, qrels


# --- metrics -----------------------------------------------------------------------------------------------------

def query_metrics(ranked: list[str], judged: dict[str, int]) -> dict[str, float]:
    """The five metrics of one query from its ranked document ids (best first, at least DEPTH when there are); 0
    for a query with no relevant document, as pytrec_eval gives."""
    gains = [judged.get(doc, 0) for doc in ranked[:DEPTH]]
    hits = [g > 0 for g in gains]
    n_relevant = sum(1 for g in judged.values() if g > 0)
    if not n_relevant:
        return dict.fromkeys(METRICS, 0.0)
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains[:10]))
    ideal = sorted(judged.values(), reverse=True)[:10]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    first = next((i for i, h in enumerate(hits[:10]) if h), None)
    precisions, found = [], 0
    for i, hit in enumerate(hits):
        if hit:
            found += 1
            precisions.append(found / (i + 1))
    return {"ndcg@10": dcg / idcg,
            "mrr@10": 0.0 if first is None else 1.0 / (first + 1),
            "recall@10": sum(hits[:10]) / n_relevant,
            "recall@100": sum(hits[:100]) / n_relevant,
            "map@100": sum(precisions) / n_relevant}


def task_metrics(per_query: dict[str, dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over the queries."""
    return {m: float(np.mean([q[m] for q in per_query.values()])) if per_query else 0.0 for m in METRICS}


def beir_ranking(query_id: str, hits: list[tuple[str, float]], ignore_identical_ids: bool = True) -> list[str]:
    """The DEPTH document ids BEIR and pytrec_eval rank from ``hits`` ((id, score), best first): without the query's
    own id (when ignored), each id once at its first, best score, and equal scores by document id, the higher
    first."""
    best: dict[str, float] = {}
    for doc, score in hits:
        if doc not in best and not (ignore_identical_ids and doc == query_id):
            best[doc] = score
    ranked = sorted(best, reverse=True)  # ties: the higher document id first ...
    ranked.sort(key=best.__getitem__, reverse=True)  # ... kept by a stable sort on the score
    return ranked[:DEPTH]


def rankings(task: RetrievalTask, scores: np.ndarray, rows: np.ndarray, ids_of) -> dict[str, list[str]]:
    """Query id -> document ids best first (``beir_ranking``), from a search's scores and row numbers of each query
    of ``task`` (-1 where fewer were found); ``ids_of`` maps the found row numbers (all queries' at once, row-major)
    to their ids in one lookup."""
    found = rows >= 0
    ids = iter(ids_of(rows[found]))
    return {q: beir_ranking(q, [(next(ids), float(s)) for s in row_scores[: int(n)]], task.ignore_identical_ids)
            for q, n, row_scores in zip(task.query_ids, found.sum(axis=1), scores)}


def score_rankings(task: RetrievalTask, ranked: dict[str, list[str]]) -> tuple[dict[str, float], dict]:
    """(task means, per-query metrics) of ``ranked`` (query id -> document ids, best first)."""
    per_query = {q: query_metrics(ranked.get(q, []), task.qrels[q]) for q in task.query_ids}
    return task_metrics(per_query), per_query


def dims_table(sts: dict[str, float | None], retrieval: dict[str, dict[str, float]], by_dim: dict) -> str:
    """The STS average and each retrieval task's nDCG@10 (x100) at the whole size and at each cut size."""
    def row(label, metrics, tasks):
        scored = [v for k, v in metrics.items() if k != "avg" and v is not None]
        avg = f"{sum(scored) / len(scored):>12.2f}" if scored else f"{'-':>12}"
        return f"{label:<10}{avg}" + "".join(f"{100 * tasks[t]['ndcg@10']:>14.2f}" for t in retrieval)

    lines = [f"{'dims':<10}{'STS avg':>12}" + "".join(f"{t[:12] + ' nDCG':>14}" for t in retrieval),
             row("all", sts, retrieval)]
    lines += [row(str(d), v["metrics"], v["retrieval"]) for d, v in sorted(by_dim.items(), reverse=True)]
    return "\n".join(lines)


def retrieval_table(results: dict[str, dict[str, float]]) -> str:
    """The retrieval results as a printed table (metrics x 100)."""
    lines = [f"{'retrieval task':<24}" + "".join(f"{m:>12}" for m in METRICS)]
    for task, values in results.items():
        lines.append(f"{task:<24}" + "".join(f"{100 * values[m]:>12.2f}" for m in METRICS))
    return "\n".join(lines)


def plot_per_query(per_query: dict[str, dict[str, dict[str, float]]], path: str | Path) -> Path:
    """One histogram of per-query nDCG@10 per task: where a mean hides queries the model never answers."""
    plt = pyplot()

    tasks = list(per_query)
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.2 * max(1, len(tasks)), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        values = [q["ndcg@10"] for q in per_query[task].values()]
        ax.hist(values, bins=np.linspace(0, 1, 21), color="tab:blue", alpha=0.8)
        ax.set_title(f"{task}: nDCG@10 {np.mean(values) if values else 0:.3f} ({len(values)} queries)", fontsize=9)
        ax.set_xlabel("nDCG@10 of a query")
        ax.set_ylabel("queries")
        ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)
