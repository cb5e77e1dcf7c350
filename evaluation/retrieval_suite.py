"""The retrieval suite of one model: each task's corpus encoded by the Ray Data actor pool into a cached index,
its queries encoded by the same pool, exact top-100 search by actors that hold the index's shards between them
(evaluation.search_actors), BEIR's metrics."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from encoders.devices import EncoderPool
from evaluation.corpus_index import corpus_index, file_fingerprint, index_outputs
from evaluation.retrieval import (
    DEPTH,
    HUB_PREFIX,
    SEARCH_DEPTH,
    BeirFormatError,
    RetrievalTask,
    corpus_text,
    hub_part,
    rankings,
    read_task,
    score_rankings,
)
from evaluation.search_actors import SearchMethod
from storage.digests import hub_revision
from storage.paths import storage_path

if TYPE_CHECKING:
    from evaluation.encode import Encodings


def retrieval_outputs(eval_cfg) -> dict[str, str]:
    """What an evaluation writes from its tasks: corpus indexes when it has retrieval tasks, else nothing."""
    return index_outputs() if eval_cfg.retrieval else {}


def corpus_dataset(source: str):
    """A task's corpus as a Ray Dataset of (id, text), read by Ray Data (never whole on the driver)."""
    import ray

    if source.startswith(HUB_PREFIX):
        return ray.data.from_huggingface(hub_part(source.removeprefix(HUB_PREFIX), "corpus")).map_batches(
            _hub_rows, batch_format="pyarrow")
    path = storage_path(source) / "corpus.jsonl"
    if not path.exists():
        raise BeirFormatError(f"{path}: missing (a BEIR folder holds corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    return ray.data.read_text(str(path)).map_batches(_parse_corpus_lines, fn_kwargs={"path": str(path)})


def _parse_corpus_lines(batch: dict[str, np.ndarray], path: str) -> dict[str, list[str]]:
    ids, texts = [], []
    for line in batch["text"]:
        if not str(line).strip():
            continue
        try:
            record = json.loads(line)
            ids.append(str(record["_id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BeirFormatError(f"{path}: a line is not a JSON object with _id and text: {str(line)[:120]!r}") from None
        texts.append(corpus_text(record))
    return {"id": ids, "text": texts}


def _hub_rows(table):
    import pyarrow as pa

    rows = table.to_pylist()
    return pa.table({"id": [str(r["_id"]) for r in rows], "text": [corpus_text(r) for r in rows]})


def corpus_key(source: str) -> str:
    """What the cached index of a task's corpus is keyed by: the file's content, or the hub dataset's name and the
    revision the local hub cache holds."""
    if source.startswith(HUB_PREFIX):
        revision = hub_revision(source.removeprefix(HUB_PREFIX), repo_type="dataset")
        return f"{source}@{revision}" if revision else source
    return file_fingerprint(storage_path(source) / "corpus.jsonl")


def evaluate_task(model_path: str, task: RetrievalTask, *, pool: EncoderPool, batch_size: int,
                  dims: list[int | None], per_query: dict | None = None, method: SearchMethod | None = None,
                  encodings: Encodings | None = None) -> dict[int | None, dict[str, float]]:
    """BEIR's five metrics of one task for one model at each of ``dims`` (None: the whole embedding; an int: its
    leading dimensions, a Matryoshka size), searched by actors that hold the corpus index between them while every
    size is scored (the queries encoded once, whole, and cut to each size, read from ``encodings`` when the job
    shares them); an approximate ``method`` adds its ``search_recall@100`` against exact search."""
    from evaluation.encode import Encodings
    from evaluation.search import normalised
    from evaluation.search_actors import search_actors

    print(f"retrieval {task.name}: {len(task.query_ids)} queries", flush=True)
    index = corpus_index(corpus_dataset(task.source), model_path, corpus_key(task.source), pool=pool,
                         batch_size=batch_size)
    encodings = encodings or Encodings(model_path, batch_size, pool)
    queries = normalised(encodings(task.query_texts, side="query"))
    results = {}
    with search_actors(index, pool, method or SearchMethod()) as searcher:
        for dim in dims:
            scores, rows = searcher.search(queries, SEARCH_DEPTH, dim=dim)
            ranked = rankings(task, scores, rows, lambda found: index.take("id", found))
            results[dim], queries_scored = score_rankings(task, ranked)
            recall = searcher.recall(queries, DEPTH, dim=dim, found=rows)  # the first DEPTH of its rows
            if recall is not None:
                results[dim]["search_recall@100"] = recall
                print(f"retrieval {task.name}: approximate search recall@100 {recall:.4f} against exact search",
                      flush=True)
            if per_query is not None and dim == dims[0]:
                per_query[task.name] = queries_scored
    return results


def read_tasks(specs) -> list[RetrievalTask]:
    """The configured tasks (each with source, split, name, max_queries), their queries and judgements read."""
    return [read_task(spec.source, spec.split, spec.name, spec.max_queries, spec.ignore_identical_ids)
            for spec in specs]


def expect_queries(encodings: Encodings, tasks: list[RetrievalTask]) -> None:
    """Every task's queries into the job's next encoding pass (with the STS sentences: one actor start)."""
    for task in tasks:
        encodings.expect(task.query_texts, side="query")


def suite_encodings(model_path: str, eval_cfg, pool: EncoderPool) -> tuple[Encodings, list[RetrievalTask]]:
    """A job's encodings of one model and its retrieval tasks (eval_cfg.retrieval, read), every task's queries
    expected: the job's first scoring (its STS suite) encodes them in the same pass."""
    from evaluation.encode import Encodings

    encodings, tasks = Encodings(model_path, eval_cfg.batch_size, pool), read_tasks(eval_cfg.retrieval)
    expect_queries(encodings, tasks)
    return encodings, tasks


def evaluate_retrieval_at(model_path: str, tasks: list[RetrievalTask], dims: list[int | None], *, pool: EncoderPool,
                          batch_size: int = 64, per_query: dict | None = None, method: SearchMethod | None = None,
                          encodings: Encodings | None = None) -> dict[int | None, dict[str, dict[str, float]]]:
    """{size: {task name: {metric: value}}} for ``tasks`` (read_tasks) at each size of ``dims`` (None: the whole
    embedding), each corpus encoded and loaded into the search actors once and every task's queries encoded in
    one pass (``encodings``: the job's, which may hold them already); ``per_query`` gets the per-query scores at
    the first size."""
    from evaluation.encode import Encodings

    encodings = encodings or Encodings(model_path, batch_size, pool)
    expect_queries(encodings, tasks)
    results: dict = {dim: {} for dim in dims}
    for task in tasks:
        found = evaluate_task(model_path, task, pool=pool, batch_size=batch_size, dims=list(dims),
                              per_query=per_query, method=method, encodings=encodings)
        for dim, means in found.items():
            results[dim][task.name] = means
    return results


def evaluate_retrieval(model_path: str, specs, *, pool: EncoderPool, batch_size: int = 64,
                       per_query: dict | None = None, dim: int | None = None, method: SearchMethod | None = None,
                       encodings: Encodings | None = None) -> dict[str, dict[str, float]]:
    """{task name: {metric: value}} of the configured tasks at one size (the model's leading ``dim`` dimensions
    when given)."""
    return evaluate_retrieval_at(model_path, read_tasks(specs), [dim], pool=pool, batch_size=batch_size,
                                 per_query=per_query, method=method, encodings=encodings)[dim]
