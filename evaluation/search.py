"""Exact nearest-neighbour search by chunked matrix products with a running top-k: scores of a block of queries
against one chunk of the corpus at a time, merged into the best ``k`` seen so far. Memory holds one
``query_block x chunk`` score matrix, never queries x corpus.

    best = RunningTopK(len(queries), k)
    for offset, chunk in corpus_chunks:          # (first row number, embeddings) of each chunk
        best.add(queries, chunk, offset)
    scores, rows = best.result()                 # [Q, k], best first; rows are corpus row numbers (-1: none)
"""

from __future__ import annotations

import os

import numpy as np
import torch

QUERY_BLOCK = 1024
RESIDENT_ENV = "RAOE_SEARCH_RESIDENT_GB"  # how much of an index a searching actor keeps on its device
CPU_RESIDENT_GB = 2.0  # default on CPU; on a GPU, half of its free memory


def normalised(embeddings: np.ndarray, dim: int | None = None) -> np.ndarray:
    """Rows scaled to unit length (float32), so a dot product is the cosine; cut first to their leading ``dim``
    dimensions when given (a Matryoshka model's smaller embedding: cutting a unit row and renormalising equals
    normalising the cut)."""
    emb = np.asarray(embeddings, dtype=np.float32)
    if dim is not None:
        if dim > emb.shape[1]:
            raise ValueError(f"eval.dims: {dim} exceeds the model's {emb.shape[1]} embedding dimensions")
        emb = emb[:, :dim]
    return emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-12)


class RunningTopK:
    """The ``k`` best corpus rows of every query over the chunks added so far, best first; among equal scores in
    the result the lower row number comes first."""

    def __init__(self, num_queries: int, k: int, device: str = "cpu"):
        self.k, self.device = k, device
        self.scores = torch.full((num_queries, k), -torch.inf, device=device)
        self.rows = torch.full((num_queries, k), -1, dtype=torch.long, device=device)

    def add(self, queries: np.ndarray | torch.Tensor, chunk: np.ndarray | torch.Tensor, offset: int,
            query_block: int = QUERY_BLOCK) -> None:
        """Merge the scores of ``queries`` (all of them, in blocks) against ``chunk`` (rows offset, offset+1, ...)."""
        corpus = (torch.from_numpy(np.array(chunk, dtype=np.float32)) if isinstance(chunk, np.ndarray)  # a copy:
                  else chunk).to(self.device)  # a memory-mapped shard is read-only
        rows = torch.arange(offset, offset + len(corpus), device=self.device)
        for start in range(0, self.scores.shape[0], query_block):
            q = _tensor(queries[start : start + query_block], self.device).float()
            block = q @ corpus.T
            top, pos = _top_lowest_first(block, min(self.k, block.shape[1]))
            self.merge(slice(start, start + len(q)), top, rows[pos])

    def merge(self, where: slice, scores: np.ndarray | torch.Tensor, rows: np.ndarray | torch.Tensor) -> None:
        """Merge found (score, row) candidates of the queries ``where`` (another searcher's top-k, -1 rows none)."""
        scores = torch.cat([self.scores[where], _tensor(scores, self.device).float()], dim=1)
        cand = torch.cat([self.rows[where], _tensor(rows, self.device).long()], dim=1)
        # best first; among equal scores the lower row number (a stable order over row numbers, then by score)
        by_row = torch.argsort(torch.where(cand < 0, torch.iinfo(torch.long).max, cand), dim=1, stable=True)
        scores, cand = scores.gather(1, by_row), cand.gather(1, by_row)
        order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, : self.k]
        self.scores[where], self.rows[where] = scores.gather(1, order), cand.gather(1, order)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.scores.cpu().numpy(), self.rows.cpu().numpy()


def _tensor(values: np.ndarray | torch.Tensor, device: str) -> torch.Tensor:
    """On the device; an array copied (one another process sent is read-only), a tensor as it is."""
    return values.to(device) if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values)).to(device)


class ResidentShards:
    """An index's shards as float32 tensors on the searching actor's device (a GPU's too: exact search scores as
    the CPU does, and promotion compares scores from either), copied once and
    kept there while they fit the budget (``RAOE_SEARCH_RESIDENT_GB``; default 2 GB on CPU, half the free memory of a
    GPU times the actor's share of it); the shards beyond it are copied from their memory maps at each pass. A search
    actor receives query block after query block: without this, every block re-read and re-copied every shard."""

    def __init__(self, device: str = "cpu", budget_bytes: float | None = None, share: float = 1.0):
        self.device = device
        self.budget = _resident_budget(device, share) if budget_bytes is None else budget_bytes
        self.kept: dict[int, torch.Tensor] = {}
        self.kept_bytes = 0

    def get(self, offset: int, shard: np.ndarray) -> torch.Tensor:
        """The shard that starts at row ``offset``, on the device."""
        if offset in self.kept:
            return self.kept[offset]
        tensor = torch.from_numpy(np.array(shard, dtype=np.float32)).to(self.device)  # a copy: the map is read-only
        if self.kept_bytes + tensor.nbytes <= self.budget:
            self.kept[offset] = tensor
            self.kept_bytes += tensor.nbytes
        return tensor


def _resident_budget(device: str, share: float = 1.0) -> float:
    """The bytes one actor keeps: the environment's figure, else on a GPU half its free memory times the actor's
    share of it (actors with gpus_per_actor 0.25 each take a quarter), else CPU_RESIDENT_GB."""
    if os.environ.get(RESIDENT_ENV):
        return float(os.environ[RESIDENT_ENV]) * 2**30
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0] / 2 * (share if 0 < share < 1 else 1.0)
    return CPU_RESIDENT_GB * 2**30


def _top_lowest_first(block: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``take`` largest entries and their columns, ascending by column; among entries equal to the
    ``take``-th largest the lowest columns (``torch.topk`` picks any of them). A row's ``take``-th place is shared by
    more entries than fit exactly when its ``take + 1``-th largest equals its ``take``-th: one more place of the same
    top-k finds those rows (counting each row's entries at or above its ``take``-th place cost nearly half the matrix
    product's time), and only they pay for the tie rule (a pass over their columns)."""
    values, pos = torch.topk(block, min(take + 1, block.shape[1]), dim=1)
    crowded = (values[:, take] == values[:, take - 1]).nonzero()[:, 0] if 0 < take < values.shape[1] else []
    values, pos = values[:, :take], pos[:, :take]
    if len(crowded):
        pos[crowded] = _lowest_of_tied(block[crowded], values[crowded, -1:], take)
    pos = pos.sort(dim=1).values
    return block.gather(1, pos), pos


def _lowest_of_tied(block: torch.Tensor, kth: torch.Tensor, take: int) -> torch.Tensor:
    above = (block > kth) | block.isnan()  # as torch.topk ranks them: NaN above every number
    tied = block == kth
    room = take - above.sum(dim=1, keepdim=True)  # the tied entries each row still takes, lowest column first
    keep = above | (tied & (tied.cumsum(dim=1) <= room))
    return keep.nonzero()[:, 1].view(block.shape[0], take)  # row-major: each row's kept columns, ascending


def exact_top_k(queries: np.ndarray, corpus: np.ndarray, k: int, chunk_rows: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best corpus rows per query of an in-memory corpus, chunk by chunk (tests, small corpora)."""
    best = RunningTopK(len(queries), min(k, len(corpus)))
    for offset in range(0, len(corpus), chunk_rows):
        best.add(queries, corpus[offset : offset + chunk_rows], offset)
    return best.result()
