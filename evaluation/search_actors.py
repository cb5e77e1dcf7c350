"""Exact search where the embeddings are: long-lived Ray actors, each holding some shards of a corpus index resident
on its device (float32, a GPU's when it has one, else memory; copied once, within RAOE_SEARCH_RESIDENT_GB),
receive large query blocks and return their local top-k; the caller merges them into the global top-k, the same rows
and order as one pass over the whole index (lower row first among equal scores).

    with search_actors(index, pool) as searcher:      # actors start, each maps and copies its shards once
        scores, rows = searcher.search(queries, k)    # [Q, k], best first; rows are index row numbers (-1: none)

The driver holds the query block and the merged [Q, k] only: never a shard. An index of 100M rows x 768 dims
(300 GB in float32) is searched by as many actors as hold it, 8 GPUs x 80 GB; each actor's share is a
contiguous run of shards balanced by rows."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from encoders.devices import EncoderPool

QUERIES_PER_CALL = 4096  # the query block each actor receives: large enough that a call's overhead is small
POINTS_PER_LIST = 39  # FAISS's minimum training points per inverted list (fewer: it warns and clusters badly)
TRAIN_PER_LIST = 64  # training points per list (FAISS asks 39-256): k-means on 1M x 384 rows stays seconds


@dataclass(frozen=True)
class SearchMethod:
    """How the search actors search: ``exact`` (a running top-k over every row), or ``faiss`` (an inverted-file index
    per actor over its shards, inner product: ``lists`` lists, null sqrt(its rows), ``probes`` of them searched
    per query), whose recall@k against exact search is measured on the first ``recall_queries`` queries."""

    kind: str = "exact"
    lists: int | None = None
    probes: int = 32
    recall_queries: int = 256

    @property
    def approximate(self) -> bool:
        return self.kind == "faiss"


def assign_shards(sizes: list[int], actors: int) -> list[list[int]]:
    """Contiguous runs of shard numbers, one per actor, of near-equal row counts (empty runs dropped)."""
    total, runs, current, done = sum(sizes), [], [], 0
    for shard, size in enumerate(sizes):
        current.append(shard)
        done += size
        if done >= total * (len(runs) + 1) / actors and len(runs) < actors - 1:
            runs.append(current)
            current = []
    return [run for run in runs + [current] if run]


class ShardSearcher:
    """A Ray actor: some shards of one index kept on its device (within ``RAOE_SEARCH_RESIDENT_GB``, the rest read
    from their memory maps at each call); the top-k of a query block over them, exact or by FAISS."""

    def __init__(self, location: str, shards: list[int], gpus: float, method: SearchMethod = SearchMethod()):
        from encoders.devices import actor_device
        from evaluation.corpus_index import CorpusIndex
        from evaluation.search import ResidentShards

        self.device, self.method = actor_device(gpus), method
        index = CorpusIndex.at(location)
        index.hold(shards)  # on object storage, this node's copy of these shards' embeddings (made once per node)
        self.shards = [index.shard(number) for number in shards]
        # FAISS holds its own copy of the rows: exact search (its recall check) then reads the memory maps
        self.resident = ResidentShards(self.device, share=gpus, budget_bytes=0 if method.approximate else None)
        self.inverted: tuple | None = None  # FAISS: (size, index, row numbers) of the size searched last
        for offset, rows in self.shards if not method.approximate else ():  # copied in now, not at the first block
            self.resident.get(offset, rows)

    def search(self, queries: np.ndarray, k: int, dim: int | None = None,
               exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if self.method.approximate and not exact:
            return self._approximate(queries, k, dim)
        import torch

        from evaluation.search import RunningTopK

        best = RunningTopK(len(queries), k, device=self.device)
        for offset, rows in self.shards:
            shard = self.resident.get(offset, rows)
            if dim is not None:  # a Matryoshka size: the shard cut and renormalised (the queries were, by the caller)
                shard = torch.nn.functional.normalize(shard[:, :dim].float(), dim=1).to(shard.dtype)
            best.add(queries, shard, offset)
        return best.result()

    def _approximate(self, queries: np.ndarray, k: int, dim: int | None) -> tuple[np.ndarray, np.ndarray]:
        if self.inverted is None or self.inverted[0] != dim:  # one size held at a time: each is a copy of the rows
            self.inverted = None
            self.inverted = (dim, *self._inverted_file(dim))
        _, index, rows = self.inverted
        if not len(rows):
            return np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64)
        scores, local = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        found = np.where(local >= 0, rows[np.clip(local, 0, None)], -1)
        return np.where(local >= 0, scores, -np.inf).astype(np.float32), found

    def _inverted_file(self, dim: int | None):
        """(FAISS IVF-flat inner-product index of this actor's rows at ``dim``, their index row numbers)."""
        import faiss

        from evaluation.search import normalised

        vectors = np.concatenate([np.asarray(rows, dtype=np.float32) for _, rows in self.shards])
        vectors = normalised(vectors, dim) if dim is not None else np.ascontiguousarray(vectors)
        numbers = np.concatenate([np.arange(offset, offset + len(rows)) for offset, rows in self.shards])
        if not len(vectors):
            return None, numbers
        lists = max(1, min(self.method.lists or round(math.sqrt(len(vectors))), len(vectors) // POINTS_PER_LIST))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(vectors.shape[1]), vectors.shape[1], lists,
                                   faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(0).choice(len(vectors), min(len(vectors), TRAIN_PER_LIST * lists),
                                                 replace=False)
        index.train(vectors[np.sort(sample)])
        index.add(vectors)
        index.nprobe = min(self.method.probes, lists)
        return index, numbers


class SearchActors:
    """The actors holding one index between them: a query block goes to each, their top-k are merged."""

    def __init__(self, actors: list, k_limit: int, method: SearchMethod = SearchMethod()):
        self.actors, self.k_limit, self.method = actors, k_limit, method

    def search(self, queries: np.ndarray, k: int, dim: int | None = None,
               exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best index rows of each (unit) query, at the leading ``dim`` dimensions when given (queries
        renormalised there; each actor does the same to its shards); by the actors' method, or exactly."""
        import ray

        from evaluation.search import RunningTopK, normalised

        k = min(k, max(1, self.k_limit))
        queries = np.asarray(queries if dim is None else normalised(queries, dim), dtype=np.float32)
        best = RunningTopK(len(queries), k)
        for start in range(0, len(queries), QUERIES_PER_CALL):
            block = ray.put(queries[start : start + QUERIES_PER_CALL])
            for scores, rows in ray.get([actor.search.remote(block, k, dim, exact) for actor in self.actors]):
                best.merge(slice(start, start + len(scores)), scores, rows)
        return best.result()

    def recall(self, queries: np.ndarray, k: int, dim: int | None = None,
               found: np.ndarray | None = None) -> float | None:
        """The approximate search's recall@k against exact search, over the first ``recall_queries`` queries: the
        share of each query's exact top-k it finds, averaged; None for exact search. ``found``: the approximate top-k
        rows of these queries when the caller has them (not searched again)."""
        if not self.method.approximate or not self.method.recall_queries or not len(queries) or not self.actors:
            return None
        sample = queries[: self.method.recall_queries]
        found = self.search(sample, k, dim)[1] if found is None else found[: len(sample), :k]
        _, truth = self.search(sample, k, dim, exact=True)
        shares = [len(set(f[f >= 0]) & set(t[t >= 0])) / max(1, int((t >= 0).sum())) for f, t in zip(found, truth)]
        return float(np.mean(shares))


@contextmanager
def search_actors(index, pool: EncoderPool, method: SearchMethod = SearchMethod()) -> Iterator[SearchActors]:
    """Actors (``pool.actors`` of them at most, each holding one shard at least, with the pool's CPUs and GPUs) holding
    ``index`` between them, searching by ``method``, ended on exit so that the next Ray Data pool gets their
    resources."""
    import ray

    sizes = index.shard_rows()  # from meta.json: the driver reads no shard
    runs = assign_shards(sizes, max(1, pool.actors))
    options = {"num_cpus": pool.cpus_per_actor, **({"num_gpus": pool.gpus_per_actor} if pool.gpus_per_actor else {})}
    remote = ray.remote(ShardSearcher).options(**options)
    actors = [remote.remote(index.location or str(index.path), run, pool.gpus_per_actor, method) for run in runs]
    try:
        yield SearchActors(actors, index.rows, method)
    finally:
        for actor in actors:
            ray.kill(actor)
