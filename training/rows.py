"""A worker's copy of the training corpus, in an order that does not depend on how it was read.

Every worker reads the whole (materialised) corpus once and then takes its micro-batches by row index
(``StepPlan.micro_rows``). Rows are put in a canonical order, by a hash of their content, so a resubmitted job
that reads the files again (Ray Data may hand out blocks in another order) sees the same rows at every step.
Memory: one copy of the training columns per worker (941k NLI pairs are a few hundred MB)."""

from __future__ import annotations

import numpy as np


def load_rows(iterator, batch_rows: int = 65_536) -> dict[str, np.ndarray]:
    """All rows of a Ray Data iterator as numpy columns, sorted by a content hash (ties are identical rows)."""
    import pandas as pd

    frames = list(iterator.iter_batches(batch_size=batch_rows, batch_format="pandas"))
    if not frames:
        raise ValueError("the training corpus reached the worker empty")
    frame = pd.concat(frames, ignore_index=True)
    hashable = frame.apply(lambda column: column.map(_scalar) if column.dtype == object else column)
    keys = pd.util.hash_pandas_object(hashable, index=False).to_numpy()
    order = np.argsort(keys, kind="stable")
    return {column: frame[column].to_numpy()[order] for column in frame.columns}


def _scalar(value):
    """A list cell (a ranked list's sentences, a teacher matrix) as one hashable string."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return "\x1f".join(map(str, value))
    return value


def take(rows: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    return {column: values[index] for column, values in rows.items()}
