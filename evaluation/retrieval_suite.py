"""The retrieval suite of one model: each task's corpus encoded by the Ray Data actor pool into a cached index,
its queries encoded by the same pool, exact top-100 search shard by shard, BEIR's metrics."""

from __future__ import annotations

import json

import numpy as np

from encoders.devices import EncoderPool
from evaluation.corpus_index import CorpusIndex, corpus_index, file_fingerprint, index_outputs
from evaluation.retrieval import (
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
from evaluation.search import RunningTopK
from storage.digests import hub_revision
from storage.paths import storage_path


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


def search_index(index: CorpusIndex, query_embeddings: np.ndarray, k: int = SEARCH_DEPTH,
                 dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k corpus rows of each (unit-length) query embedding, shard by shard; at the leading ``dim``
    dimensions of both, renormalised, when given (the index holds the whole embeddings)."""
    from evaluation.search import normalised

    best = RunningTopK(len(query_embeddings), min(k, max(1, index.rows)))
    queries = query_embeddings if dim is None else normalised(query_embeddings, dim)
    for offset, shard in index.shards():
        best.add(queries, shard if dim is None else normalised(shard, dim), offset)
    return best.result()


def evaluate_task(model_path: str, task: RetrievalTask, *, pool: EncoderPool, batch_size: int,
                  per_query: dict | None = None, dim: int | None = None,
                  queries_cache: dict | None = None) -> dict[str, float]:
    """BEIR's five metrics of one task for one model (at its leading ``dim`` dimensions when given; the queries'
    whole embeddings kept in ``queries_cache`` by task for the next size)."""
    from evaluation.encode import ray_encode
    from evaluation.search import normalised

    print(f"retrieval {task.name}: {len(task.query_ids)} queries", flush=True)
    index = corpus_index(corpus_dataset(task.source), model_path, corpus_key(task.source), pool=pool,
                         batch_size=batch_size)
    cache = {} if queries_cache is None else queries_cache
    if task.name not in cache:
        cache[task.name] = normalised(ray_encode(model_path, task.query_texts, batch_size=batch_size, pool=pool,
                                                 side="query"))
    queries = cache[task.name]
    scores, rows = search_index(index, queries, dim=dim)
    ranked = rankings(task, scores, rows, lambda found: index.take("id", found))
    means, queries_scored = score_rankings(task, ranked)
    if per_query is not None:
        per_query[task.name] = queries_scored
    return means


def evaluate_retrieval(model_path: str, tasks, *, pool: EncoderPool, batch_size: int = 64,
                       per_query: dict | None = None, dim: int | None = None,
                       queries_cache: dict | None = None) -> dict[str, dict[str, float]]:
    """{task name: {metric: value}} for the configured tasks (each with source, split, name, max_queries), at the
    model's leading ``dim`` dimensions when given (its corpus index is the same one; ``queries_cache`` shares the
    queries' embeddings between sizes)."""
    results = {}
    for spec in tasks:
        task = read_task(spec.source, spec.split, spec.name, spec.max_queries, spec.ignore_identical_ids)
        results[task.name] = evaluate_task(model_path, task, pool=pool, batch_size=batch_size, per_query=per_query,
                                           dim=dim, queries_cache=queries_cache)
    return results
