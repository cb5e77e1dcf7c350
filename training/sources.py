"""Mixed-source training (data.sources): which corpus each optimizer step takes its whole global batch from.

Each step draws one source with probability weight / sum of weights from a stream seeded by the run's seed alone, so
the draw of step k is the same on any worker count, after any resume and whatever the run's length; a source's own
steps (its k-th draw) walk its corpus as a single-corpus run would (training.plan). Batches are homogeneous: one
kind of data, one objective and one set of prompts per step, so a model cannot learn which source a text came
from. Free of torch: the driver counts each source's steps for its report."""

from __future__ import annotations

import numpy as np

SOURCE_STREAM = 0x5EED_50C  # keeps the sources' draws apart from every other use of the seed


def source_schedule(weights: list[float], seed: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(the source of each of ``steps`` steps, that step's number among its source's steps). A prefix of the draws
    is the same for any ``steps`` (one uniform stream, read in order)."""
    uniform = np.random.default_rng([seed, SOURCE_STREAM]).random(steps)
    cdf = np.cumsum(np.asarray(weights, dtype=np.float64))
    drawn = np.minimum(np.searchsorted(cdf / cdf[-1], uniform, side="right"), len(weights) - 1)
    local = np.zeros(steps, dtype=np.int64)
    for source in range(len(weights)):
        mask = drawn == source
        local[mask] = np.arange(int(mask.sum()))
    return drawn, local


def steps_per_source(weights: list[float], seed: int, steps: int) -> list[int]:
    drawn, _ = source_schedule(weights, seed, steps)
    return np.bincount(drawn, minlength=len(weights)).tolist()
