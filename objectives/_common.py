"""Small tensor helpers shared by the loss families (no Ray, no I/O)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Batches up to this size use the dense B x B form; larger ones the O(B log B) sorted form. Measured here
# (benchmarks/results/objectives.md): the sorted form is already 2-3x faster at B = 512.
DENSE_MAX_BATCH = 128


def competition_rank(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each score in the batch, 1-based; ties share the lowest rank (scipy rankdata 'min')."""
    sorted_scores, _ = torch.sort(scores)
    return torch.searchsorted(sorted_scores, scores, side="left") + 1


def log1p_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    """log(1 + sum(exp(logits))) computed stably; an empty input gives 0."""
    flat = logits.reshape(-1)
    zero = torch.zeros(1, dtype=flat.dtype, device=flat.device)
    return torch.logsumexp(torch.cat([zero, flat]), dim=0)


def suffix_logsumexp(values: torch.Tensor) -> torch.Tensor:
    """out[p] = logsumexp(values[p:]) for p in 0..B, with out[B] = -inf (empty suffix)."""
    suffix = torch.logcumsumexp(values.flip(0), dim=0).flip(0)
    empty = torch.full((1,), float("-inf"), dtype=values.dtype, device=values.device)
    return torch.cat([suffix, empty])


def pair_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine of each row pair, [B]: normalise, then a row-wise dot (15-20% faster forward+backward than
    F.cosine_similarity here, the form sentence-transformers' losses use)."""
    return (F.normalize(a, dim=-1) * F.normalize(b, dim=-1)).sum(dim=-1)


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, [len(a), len(b)]."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


class _SafeArccos(torch.autograd.Function):
    """arccos whose gradient stays finite at cos = +-1 (where d/dx arccos is -inf)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = x.clamp(-1.0, 1.0)
        ctx.save_for_backward(x)
        return torch.acos(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        eps = torch.finfo(x.dtype).eps
        return -grad / torch.sqrt((1.0 - x * x).clamp_min(eps))


def safe_arccos(x: torch.Tensor) -> torch.Tensor:
    """theta = arccos(x) for x in [-1, 1]; the gradient is bounded by 1/sqrt(eps) at the ends."""
    return _SafeArccos.apply(x)


def choose_form(method: str, batch_size: int) -> str:
    """'dense' or 'sorted' for method 'auto' | 'dense' | 'sorted'."""
    if method == "auto":
        return "dense" if batch_size <= DENSE_MAX_BATCH else "sorted"
    if method not in ("dense", "sorted"):
        raise ValueError(f"method must be 'auto', 'dense' or 'sorted', got {method!r}")
    return method
