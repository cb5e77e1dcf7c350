"""How many pairs each worker takes per micro-batch and how many optimizer steps a run has.

Pure arithmetic, shared by the driver (to reject impossible configs before any Ray resource is taken)
and the workers (so every worker runs the same number of steps and collectives line up)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepPlan:
    rows: int  # training pairs after validation
    world: int  # Ray Train workers
    global_batch: int  # pairs per optimizer step over all workers
    grad_accum: int  # micro-batches per optimizer step
    micro_batch: int  # pairs per worker per micro-batch
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    @property
    def rows_per_worker(self) -> int:
        return self.rows // self.world  # Ray Train's streaming split gives every worker the same count

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, micro-batches of that epoch already consumed) after ``step`` optimizer steps."""
        return step // self.steps_per_epoch, (step % self.steps_per_epoch) * self.grad_accum

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
    steps_per_epoch = (rows // world) // micro // grad_accum
    if steps_per_epoch < 1:
        raise ValueError(
            f"trainer.global_batch_size ({global_batch}) is larger than the training data ({rows} pairs over "
            f"{world} worker(s)); lower it or add data"
        )
    total = max_steps if max_steps is not None else max(1, math.ceil(epochs * steps_per_epoch))
    return StepPlan(rows=rows, world=world, global_batch=global_batch, grad_accum=grad_accum, micro_batch=micro,
                    steps_per_epoch=steps_per_epoch, total_steps=total,
                    warmup_steps=int(round(warmup_ratio * total)))
