"""A rotation of a model's embedding onto its principal axes: the same model, its first dimensions holding the most
variance, so an embedding cut short (a Matryoshka size, ``eval.dims``, serving's ``dimensions``) loses the least.

The rotation is orthogonal, so no cosine or dot product between whole embeddings changes; only what a cut keeps does.
The axes are those of the model's own unit-length embeddings of a corpus, the mean subtracted for the fit (not when
applied). It is a sentence-transformers ``Dense`` module (no bias, no activation), the model's last but for a
Normalize: every loader, export (ONNX carries it beside the graph) and serving stack computes it, and training starts
from it (``build_encoder`` keeps Dense modules after pooling), so a Matryoshka objective refines the cut the rotation
made. Measured on
MiniLM (docs/retrieval.md): SNLI-test nDCG@10 at 128 of 384 dimensions 62.82 rotated, 60.50 cut as it is; 63.28
after the retrieval recipe's Matryoshka training from the rotated model.

    axes = PrincipalAxes(384)
    for batch in embeddings:  # any number of (rows, 384) arrays
        axes.add(batch)
    weight, variances = axes.rotation()
    share_kept(variances, [64, 128])  # what the first 64 and 128 rotated dimensions hold
    with_rotation(model, weight)  # then export_encoder(model, folder)
"""

from __future__ import annotations

import numpy as np
import torch


class PrincipalAxes:
    """Running sums over unit-length embeddings (float64: a count, a sum and a sum of outer products, which add
    across shards and workers) from which the principal axes of their centred covariance come."""

    def __init__(self, dim: int):
        self.dim = dim
        self.count = 0
        self.total = np.zeros(dim)
        self.outer = np.zeros((dim, dim))

    def add(self, embeddings: np.ndarray) -> None:
        rows = np.asarray(embeddings, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"embeddings of width {self.dim} expected, got shape {rows.shape}")
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        self.count += len(rows)
        self.total += rows.sum(axis=0)
        self.outer += rows.T @ rows

    def covariance(self) -> np.ndarray:
        if self.count <= self.dim:
            raise ValueError(f"a rotation of {self.dim} dimensions needs more than {self.dim} embeddings, got "
                             f"{self.count}: its last axes would be arbitrary")
        mean = self.total / self.count
        return self.outer / self.count - np.outer(mean, mean)

    def rotation(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight, variances): the principal axes as the rows of an orthogonal matrix, most variance first, each
        signed so its largest component is positive (the same data gives the same matrix); the variance along each."""
        values, vectors = np.linalg.eigh(self.covariance())
        order = np.argsort(-values, kind="stable")
        weight = vectors[:, order].T
        largest = weight[np.arange(self.dim), np.abs(weight).argmax(axis=1)]
        weight *= np.where(largest < 0, -1.0, 1.0)[:, None]
        return weight, np.clip(values[order], 0.0, None)

    def variances(self) -> np.ndarray:
        """The variance along each coordinate of the embedding as it is (rotated: ``rotation()``'s variances)."""
        return np.clip(np.diag(self.covariance()), 0.0, None)


def share_kept(variances: np.ndarray, dims: list[int]) -> dict[int, float]:
    """The share of the total variance the first ``d`` coordinates hold, for each ``d``."""
    total = max(float(variances.sum()), 1e-30)
    return {d: float(variances[:d].sum() / total) for d in dims}


def orthogonality_error(weight: np.ndarray) -> float:
    """max |W W^T - I| of the weight as stored (float32): how far whole-embedding cosines can move."""
    stored = np.asarray(weight, dtype=np.float32).astype(np.float64)
    return float(np.abs(stored @ stored.T - np.eye(len(stored))).max())


def with_rotation(model, weight: np.ndarray) -> None:
    """Append the rotation to ``model`` (a SentenceTransformer) as a Dense module in the dtype of its weights: last,
    or just before a final Normalize (a rotation keeps unit length, so either order computes the same), after any
    Dense head the fit's embeddings already went through."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    dim = int(model.get_embedding_dimension())
    if weight.shape != (dim, dim):
        raise ValueError(f"a rotation of the model's {dim}-dimension embedding must be {dim} x {dim}, got "
                         f"{weight.shape}")
    dense = Dense(dim, dim, bias=False, activation_function=torch.nn.Identity(),
                  init_weight=torch.tensor(weight, dtype=torch.float32))
    place = len(model) - 1 if isinstance(model[len(model) - 1], Normalize) else len(model)
    model.insert(place, dense.to(device=model.device, dtype=next(model.parameters()).dtype))
