"""Exact search where the embeddings are: long-lived Ray actors, each holding some shards of a corpus index resident
on its device (a GPU in fp16 when it has one, else float32 on CPU; copied once, within RAOE_SEARCH_RESIDENT_GB),
receive large query blocks and return their local top-k; the caller merges them into the global top-k, the same rows
and order as one pass over the whole index (lower row first among equal scores).

    with search_actors(index, pool) as searcher:      # actors start, each maps and copies its shards once
        scores, rows = searcher.search(queries, k)    # [Q, k], best first; rows are index row numbers (-1: none)

The driver holds the query block and the merged [Q, k] only: never a shard. An index of 100M rows x 768 dims
(300 GB in float32) is searched by as many actors as hold it, 8 GPUs x 80 GB in fp16; each actor's share is a
contiguous run of shards balanced by rows."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

from encoders.devices import EncoderPool

QUERIES_PER_CALL = 4096  # the query block each actor receives: large enough that a call's overhead is small


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
    from their memory maps at each call); the top-k of a query block over them."""

    def __init__(self, location: str, shards: list[int], gpus: float):
        from encoders.devices import actor_device
        from evaluation.corpus_index import CorpusIndex
        from evaluation.search import ResidentShards

        self.device = actor_device(gpus)
        index = CorpusIndex.at(location)  # on object storage, this node's copy (made once per node)
        wanted = set(shards)
        self.shards = [(offset, rows) for number, (offset, rows) in enumerate(index.shards()) if number in wanted]
        self.resident = ResidentShards(self.device, share=gpus)
        for offset, rows in self.shards:  # copied in now, not at the first query block
            self.resident.get(offset, rows)

    def search(self, queries: np.ndarray, k: int, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        import torch

        from evaluation.search import RunningTopK

        best = RunningTopK(len(queries), k, device=self.device)
        for offset, rows in self.shards:
            shard = self.resident.get(offset, rows)
            if dim is not None:  # a Matryoshka size: the shard cut and renormalised (the queries were, by the caller)
                shard = torch.nn.functional.normalize(shard[:, :dim].float(), dim=1).to(shard.dtype)
            best.add(queries, shard, offset)
        return best.result()


class SearchActors:
    """The actors holding one index between them: a query block goes to each, their top-k are merged."""

    def __init__(self, actors: list, k_limit: int):
        self.actors, self.k_limit = actors, k_limit

    def search(self, queries: np.ndarray, k: int, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best index rows of each (unit) query, at the leading ``dim`` dimensions when given (queries
        renormalised there; each actor does the same to its shards)."""
        import ray

        from evaluation.search import RunningTopK, normalised

        k = min(k, max(1, self.k_limit))
        queries = np.asarray(queries if dim is None else normalised(queries, dim), dtype=np.float32)
        best = RunningTopK(len(queries), k)
        for start in range(0, len(queries), QUERIES_PER_CALL):
            block = ray.put(queries[start : start + QUERIES_PER_CALL])
            for scores, rows in ray.get([actor.search.remote(block, k, dim) for actor in self.actors]):
                best.merge(slice(start, start + len(scores)), scores, rows)
        return best.result()


@contextmanager
def search_actors(index, pool: EncoderPool) -> Iterator[SearchActors]:
    """Actors (``pool.actors`` of them at most, one per shard at least, each with the pool's CPUs and GPUs) holding
    ``index`` between them, ended on exit so that the next Ray Data pool gets their resources."""
    import ray

    sizes = [len(rows) for _, rows in index.shards()]
    runs = assign_shards(sizes, max(1, pool.actors))
    options = {"num_cpus": pool.cpus_per_actor, **({"num_gpus": pool.gpus_per_actor} if pool.gpus_per_actor else {})}
    remote = ray.remote(ShardSearcher).options(**options)
    actors = [remote.remote(index.location or str(index.path), run, pool.gpus_per_actor) for run in runs]
    try:
        yield SearchActors(actors, index.rows)
    finally:
        for actor in actors:
            ray.kill(actor)
