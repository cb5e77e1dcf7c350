"""How many pairs each worker takes per micro-batch, how many optimizer steps a run has, and which rows each
micro-batch holds.

Pure arithmetic, shared by the driver (to reject impossible configs before any Ray resource is taken) and the
workers. The rows of a micro-batch are a function of (seed, step, micro-batch, rank) alone: every epoch is one
seeded permutation of the corpus, step k of the epoch takes the next ``global_batch`` rows of it, each of the
``grad_accum`` micro-batches takes the next ``global_batch / grad_accum`` of those, and worker r its r-th slice.
So N workers gather exactly the global micro-batches one worker trains on, and a resumed run picks up the
same rows at any step (nothing depends on how Ray Data handed out blocks, or on what ran before).

Each step's rows are also cut into chunks of ``chunk_size`` in the step's own order (``trainer.chunk_size``, default
a worker's micro-batch): a chunk is one encoder call with its own length buckets and its own dropout masks, seeded by
its index in the step (``chunk_index``). A worker's slice is whole chunks, so the embeddings of a step are the same
on any worker count that divides the chunks.

The permutation is computed entry by entry (``permuted``: a keyed Feistel bijection), never held whole: a worker
takes the entries of its own micro-batch, so its memory does not grow with the corpus (a whole permutation of
100M rows is 800 MB, per worker and per pass)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    rows: int  # training rows after validation
    world: int  # Ray Train workers
    global_batch: int  # rows per optimizer step over all workers
    grad_accum: int  # micro-batches per optimizer step
    micro_batch: int  # rows per worker per micro-batch
    chunk_size: int  # rows per encoder call (one chunk: its own length buckets and dropout seed)
    # Full global batches per pass. The remainder rows (rows % global_batch) sit out that pass: each pass is a fresh
    # permutation, so which rows sit out changes from pass to pass, and nothing is carried over.
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The whole permutation of row indices for one pass over the corpus (for checks: workers never build it)."""
        return permuted(np.arange(self.rows), self.rows, seed, epoch)

    def micro_rows(self, seed: int, step: int, micro: int, rank: int) -> np.ndarray:
        """Row indices of worker ``rank``'s micro-batch ``micro`` of optimizer step ``step`` (0-based): its slice
        of the pass's permutation, ``epoch_order(seed, step // steps_per_epoch)``, computed for that slice alone."""
        start = (step % self.steps_per_epoch) * self.global_batch + (micro * self.world + rank) * self.micro_batch
        return permuted(np.arange(start, start + self.micro_batch), self.rows, seed, step // self.steps_per_epoch)

    @property
    def chunks_per_micro(self) -> int:
        """Chunks in a worker's micro-batch."""
        return self.micro_batch // self.chunk_size

    def chunk_index(self, micro: int, rank: int, chunk: int) -> int:
        """The place in its step of worker ``rank``'s chunk ``chunk`` of micro-batch ``micro``: the same chunk of
        rows has the same index on any worker count."""
        return (micro * self.world + rank) * self.chunks_per_micro + chunk

    def for_world(self, world: int) -> "StepPlan":
        """The same steps on ``world`` workers (elastic training): the same global batches in the same chunks, each
        worker's share of them resized."""
        micro, _ = batch_shape(self.global_batch, world, self.grad_accum, self.chunk_size)
        return replace(self, world=world, micro_batch=micro)

    def as_dict(self) -> dict:
        return asdict(self)


FEISTEL_ROUNDS = 6


def permuted(positions: np.ndarray, rows: int, seed: int, epoch: int) -> np.ndarray:
    """Entries ``positions`` of a seeded pseudo-random permutation of ``range(rows)``, one per (seed, epoch).

    A balanced Feistel network over the smallest even number of bits that holds ``rows`` is a bijection of
    ``[0, 4^h)``; walking the cycle (applying it again while a value falls outside ``[0, rows)``) makes it one of
    ``[0, rows)`` (Black and Rogaway, "Ciphers with Arbitrary Finite Domains", 2002). The domain is under 4x
    ``rows``, so a walk takes fewer than 4 rounds on average."""
    positions = np.asarray(positions, dtype=np.uint64)
    if rows <= 1:
        return positions.astype(np.int64)
    half = (max(1, (rows - 1).bit_length()) + 1) // 2
    mask = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch]).generate_state(FEISTEL_ROUNDS, dtype=np.uint64)
    out = _feistel(positions, half, mask, keys)
    outside = out >= rows
    while outside.any():
        out[outside] = _feistel(out[outside], half, mask, keys)
        outside = out >= rows
    return out.astype(np.int64)


def _feistel(values: np.ndarray, half: int, mask: np.uint64, keys: np.ndarray) -> np.ndarray:
    left, right = values >> np.uint64(half), values & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half)) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every output bit depends on every input bit (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def batch_shape(global_batch: int, world: int, grad_accum: int = 1, chunk_size: int | None = None) -> tuple[int, int]:
    """(rows per worker per micro-batch, rows per chunk); ValueError naming the config keys when they do not divide.
    Needs no data: the driver checks it before Ray starts."""
    if global_batch % (world * grad_accum):
        raise ValueError(
            f"trainer.global_batch_size ({global_batch}) must be divisible by trainer.num_workers x trainer.grad_accum "
            f"({world} x {grad_accum})"
        )
    micro = global_batch // (world * grad_accum)
    chunk = micro if chunk_size is None else chunk_size
    if micro % chunk:
        raise ValueError(
            f"trainer.chunk_size ({chunk}) must divide the rows each worker takes per micro-batch, "
            f"trainer.global_batch_size / (trainer.num_workers x trainer.grad_accum) = {global_batch} / "
            f"({world} x {grad_accum}) = {micro}"
        )
    return micro, chunk


def elastic_chunk(global_batch: int, workers: tuple[int, int], grad_accum: int = 1,
                  chunk_size: int | None = None) -> int:
    """The chunk size of a run on ``workers`` (min, max): ``chunk_size``, or unset a worker's micro-batch at max;
    ValueError naming the keys unless it divides each worker's micro-batch at every count from min to max (the
    workers of a step must hold whole chunks: the same chunks, so the same masks, on any of those counts)."""
    low, high = workers
    _, chunk = batch_shape(global_batch, high, grad_accum, chunk_size)
    for world in range(low, high + 1):
        try:
            batch_shape(global_batch, world, grad_accum, chunk)
        except ValueError as exc:
            raise ValueError(f"trainer.num_workers [{low}, {high}] (elastic) may run on {world} workers: {exc}"
                             + ("" if chunk_size else f" (trainer.chunk_size unset: {chunk}, a worker's micro-batch "
                                                      f"on {high})")) from None
    return chunk


def plan_steps(rows: int, *, world: int, global_batch: int, grad_accum: int = 1, chunk_size: int | None = None,
               epochs: float = 1.0, max_steps: int | None = None, warmup_ratio: float = 0.0) -> StepPlan:
    """Raise ValueError naming the config key when the numbers cannot work."""
    micro, chunk = batch_shape(global_batch, world, grad_accum, chunk_size)
    steps_per_epoch = rows // global_batch
    if steps_per_epoch < 1:
        raise ValueError(
            f"trainer.global_batch_size ({global_batch}) is larger than the training data ({rows} rows); "
            f"lower it or add data"
        )
    total = max_steps if max_steps is not None else max(1, math.ceil(epochs * steps_per_epoch))
    return StepPlan(rows=rows, world=world, global_batch=global_batch, grad_accum=grad_accum, micro_batch=micro,
                    chunk_size=chunk, steps_per_epoch=steps_per_epoch, total_steps=total,
                    warmup_steps=int(round(warmup_ratio * total)))
