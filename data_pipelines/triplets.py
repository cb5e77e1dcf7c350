"""Supervised SimCSE's training data from NLI pairs: for each premise, (premise, entailment hypothesis,
contradiction hypothesis). The contradiction becomes the anchor's hard negative (SimCSE Sec. 4; SAN/HiNCE use
the same slot for syntactically aligned negatives)."""

from __future__ import annotations

import numpy as np

from data_pipelines.records import LABELS

TRIPLET_COLUMNS = ("text1", "text2", "text_neg", "label", "similarity")


def triplets_of_group(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One premise's pairs -> at most one triplet: an entailment and a contradiction hypothesis (the first of
    each in text order, so the choice does not depend on row order). A premise without both yields nothing."""
    labels = [int(x) for x in group["label"]]

    def first(label: str) -> int | None:
        rows = [i for i, x in enumerate(labels) if x == LABELS[label]]
        return min(rows, key=lambda i: str(group["text2"][i])) if rows else None

    entail, contra = first("entailment"), first("contradiction")
    if entail is None or contra is None:
        return {c: np.array([], dtype=object) for c in TRIPLET_COLUMNS}
    similarity = group["similarity"][entail] if "similarity" in group else None
    return {"text1": np.array([group["text1"][entail]], dtype=object),
            "text2": np.array([group["text2"][entail]], dtype=object),
            "text_neg": np.array([group["text2"][contra]], dtype=object),
            "label": np.array([LABELS["entailment"]]),
            "similarity": np.array([similarity], dtype=object)}


def nli_triplets(ds):
    """A Ray Dataset of NLI pairs -> SimCSE triplets, sorted by premise so the result does not depend on how
    the groupby happened to be scheduled."""
    return ds.groupby("text1").map_groups(triplets_of_group, batch_format="numpy").sort("text1")
