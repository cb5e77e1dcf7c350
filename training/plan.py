"""How many pairs each worker takes per micro-batch, how many optimizer steps a run has, and which rows each
micro-batch holds.

Pure arithmetic, shared by the driver (to reject impossible configs before any Ray resource is taken) and the
workers. The rows of a micro-batch are a function of (seed, step, micro-batch, rank) alone: every epoch is one
seeded permutation of the corpus, step k of the epoch takes the next ``global_batch`` rows of it, each of the
``grad_accum`` micro-batches takes the next ``global_batch / grad_accum`` of those, and worker r its r-th slice.
So N workers gather exactly the global micro-batches one worker trains on, and a resumed run picks up the
same rows at any step (nothing depends on how Ray Data handed out blocks, or on what ran before)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    rows: int  # training rows after validation
    world: int  # Ray Train workers
    global_batch: int  # rows per optimizer step over all workers
    grad_accum: int  # micro-batches per optimizer step
    micro_batch: int  # rows per worker per micro-batch
    # Full global batches per pass. The remainder rows (rows % global_batch) sit out that pass: each pass is a fresh
    # permutation, so which rows sit out changes from pass to pass, and nothing is carried over.
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The permutation of row indices for one pass over the corpus."""
        return np.random.default_rng([seed, epoch]).permutation(self.rows)

    def micro_rows(self, order: np.ndarray, step: int, micro: int, rank: int) -> np.ndarray:
        """Row indices of worker ``rank``'s micro-batch ``micro`` of optimizer step ``step`` (0-based), taken
        from ``order`` = ``epoch_order(seed, step // steps_per_epoch)``."""
        start = (step % self.steps_per_epoch) * self.global_batch + (micro * self.world + rank) * self.micro_batch
        return order[start: start + self.micro_batch]

    def as_dict(self) -> dict:
        return asdict(self)


def plan_steps(rows: int, *, world: int, global_batch: int, grad_accum: int = 1, epochs: float = 1.0,
               max_steps: int | None = None, warmup_ratio: float = 0.0) -> StepPlan:
    """Raise ValueError naming the config key when the numbers cannot work."""
    if global_batch % (world * grad_accum):
        raise ValueError(
            f"trainer.global_batch_size ({global_batch}) must be divisible by trainer.num_workers x trainer.grad_accum "
            f"({world} x {grad_accum})"
        )
    micro = global_batch // (world * grad_accum)
    steps_per_epoch = rows // global_batch
    if steps_per_epoch < 1:
        raise ValueError(
            f"trainer.global_batch_size ({global_batch}) is larger than the training data ({rows} rows); "
            f"lower it or add data"
        )
    total = max_steps if max_steps is not None else max(1, math.ceil(epochs * steps_per_epoch))
    return StepPlan(rows=rows, world=world, global_batch=global_batch, grad_accum=grad_accum, micro_batch=micro,
                    steps_per_epoch=steps_per_epoch, total_steps=total,
                    warmup_steps=int(round(warmup_ratio * total)))
