"""Softmax cross-entropy of some anchors against every candidate of the global batch, in tiles: no anchors x
candidates logit matrix is ever held whole (the idea of Inf-CL: Cheng et al. 2024, "Breaking the Memory Barrier:
Near Infinite Batch Size Scaling for Contrastive Loss").

Forward runs over tiles of candidates with a running log-sum-exp and keeps one number per anchor; backward
recomputes each tile's logits and adds its part of the gradient. The in-batch losses (InfoNCE, HiNCE, RSE's
relational loss, AnglE's in-batch negatives) are all this one computation: candidates with a scale each (a
temperature per block), some left out of the softmax (placeholders, false negatives by text id), and each anchor's
target candidate, which is never left out. The result equals the dense ``cross_entropy(logits, targets)`` row by row,
value and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits per tile: anchors x candidates <= this (64 MB of fp32, plus a few tile-sized temporaries in backward).
TILE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Exclusion:
    """Candidate j leaves anchor i's softmax when ``anchor_keys[i] == candidate_keys[j]`` (and ``candidate_if[j]``),
    unless j is i's target. Keys are text ids (never negative: a key of -1 matches nothing)."""

    anchor_keys: torch.Tensor  # [n] long
    candidate_keys: torch.Tensor  # [m] long
    candidate_if: torch.Tensor | None = None  # [m] bool


def _tile_logits(queries, candidates, scales, valid, exclusions, targets, start: int, end: int) -> torch.Tensor:
    logits = (queries @ candidates[start:end].T) * scales[start:end]
    out = ~valid[start:end][None, :].expand_as(logits)
    for rule in exclusions:
        hit = rule.anchor_keys[:, None] == rule.candidate_keys[None, start:end]
        if rule.candidate_if is not None:
            hit &= rule.candidate_if[None, start:end]
        out = out | hit
    columns = torch.arange(start, end, device=logits.device)
    out &= targets[:, None] != columns[None, :]
    return logits.masked_fill(out, float("-inf"))


def _tile_width(anchors: int, candidates: int) -> int:
    return max(1, min(candidates, TILE_ELEMENTS // max(1, anchors)))


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, candidates, scales, valid, targets, exclusions):  # noqa: D102
        n, m = queries.shape[0], candidates.shape[0]
        width = _tile_width(n, m)
        lse = torch.full((n,), float("-inf"), dtype=queries.dtype, device=queries.device)
        for start in range(0, m, width):
            logits = _tile_logits(queries, candidates, scales, valid, exclusions, targets, start, min(m, start + width))
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        target_logits = (queries * candidates[targets]).sum(dim=1) * scales[targets]
        ctx.save_for_backward(queries, candidates, scales, valid, targets, lse)
        ctx.exclusions, ctx.width = exclusions, width
        return lse - target_logits

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        queries, candidates, scales, valid, targets, lse = ctx.saved_tensors
        m = candidates.shape[0]
        grad_q, grad_c = torch.zeros_like(queries), torch.zeros_like(candidates)
        for start in range(0, m, ctx.width):
            end = min(m, start + ctx.width)
            logits = _tile_logits(queries, candidates, scales, valid, ctx.exclusions, targets, start, end)
            weights = torch.exp(logits - lse[:, None]) * grad[:, None] * scales[None, start:end]  # softmax x dL/dl
            grad_q += weights @ candidates[start:end]
            grad_c[start:end] += weights.T @ queries
        at_target = (grad * scales[targets])[:, None]
        grad_q -= at_target * candidates[targets]
        grad_c.index_add_(0, targets, -at_target * queries)
        return grad_q, grad_c, None, None, None, None


def tiled_cross_entropy(queries: torch.Tensor, candidates: torch.Tensor, scales: torch.Tensor, targets: torch.Tensor,
                        valid: torch.Tensor | None = None, exclusions: tuple[Exclusion, ...] = ()) -> torch.Tensor:
    """Per anchor, ``-logit[i, targets[i]] + logsumexp_j logit[i, j]`` with ``logit[i, j] = scales[j] * queries[i] .
    candidates[j]`` over the candidates that are ``valid`` and not excluded (the target always counts), [n].

    Args:
        queries: [n, d] (normalised: cosines). candidates: [m, d] (normalised). scales: [m] (1 / temperature).
        targets: [n] long, each anchor's candidate. valid: [m] bool, or None for all. exclusions: per-anchor rules.
    """
    valid = torch.ones(candidates.shape[0], dtype=torch.bool, device=candidates.device) if valid is None else valid
    return _TiledCrossEntropy.apply(queries, candidates, scales.to(queries.dtype), valid.bool(), targets,
                                    tuple(exclusions))
