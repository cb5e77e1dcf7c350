"""RAOE Rank Margin objective (Eq. 2) and CoSENT, its margin-0 special case.

L_rank = log(1 + sum_{r_j - r_i > I} exp(tau (c_i - c_j))), r = competition rank of the score S
in the (global) batch. Two exact forms: dense B x B (small batches) and sorted, O(B log B) time
and O(B) memory (for each i the admissible j form a suffix of the pairs sorted by rank).
"""

from __future__ import annotations

import math

import torch

from objectives._common import choose_form, competition_rank, log1p_sum_exp, suffix_logsumexp


def rank_margin_loss(
    cos: torch.Tensor,
    scores: torch.Tensor,
    *,
    margin: float = 2,
    tau: float = 20.0,
    method: str = "auto",
) -> torch.Tensor:
    """RAOE Rank Margin (Eq. 2): a pair ranked more than ``margin`` places below another by its similarity S must
    have the lower cosine, with a soft penalty ``log(1 + sum exp(tau (c_i - c_j)))`` over all such (i, j).

    Args:
        cos: [B] cosine of each pair of the global batch.
        scores: [B] continuous similarity S of each pair (competition-ranked within the batch).
        margin: rank gap I a pair must exceed to count (0 gives CoSENT).
        tau: scale of the cosine differences (multiplies, as in sentence-transformers).
        method: "dense" (B x B), "sorted" (O(B log B)) or "auto" (by batch size); equal results.

    Inputs (config name ``rank_margin``): pairs with S, i.e. ``pairs`` or ``sts`` data annotated by
    ``ray_jobs/annotate.py``. Batch fields: emb1, emb2, scores.

    Reference: Zhou, Huang & Miao, Rank-Awareness and Angular Constraints (objectives.references.RAOE).

    Example::

        objective: {weights: {rank_margin: 1.0, gated_angle: 1.0}, rank_margin: {margin: 2.0, tau: 20.0}}

        loss = rank_margin_loss(torch.tensor([0.9, 0.2, 0.5]), torch.tensor([0.95, 0.1, 0.6]), margin=0)
    """
    if cos.shape != scores.shape or cos.dim() != 1:
        raise ValueError(f"cos and scores must be 1-d of equal length, got {tuple(cos.shape)} and {tuple(scores.shape)}")
    if choose_form(method, cos.numel()) == "dense":
        return _dense(cos, competition_rank(scores).to(torch.float64), margin, tau)
    return _sorted(cos, scores, margin, tau)


def cosent_loss(cos: torch.Tensor, scores: torch.Tensor, *, tau: float = 20.0, method: str = "auto") -> torch.Tensor:
    """CoSENT (Su 2022; AnglE Eq. 1): every pair with a higher score must have the higher cosine,
    ``log(1 + sum_{s_j > s_i} exp(tau (c_i - c_j)))``; the Rank Margin objective at margin 0.

    Args:
        cos: [B] pair cosines. scores: [B] gold similarity (any scale: only its order counts).
        tau: scale (multiplies). method: "dense", "sorted" or "auto".

    Inputs (config name ``cosent``): STS or annotated NLI pairs. Batch fields: emb1, emb2, scores.

    Reference: objectives.references.COSENT, ANGLE.

    Example::

        objective: {weights: {cosent: 1.0}, cosent: {tau: 20.0}}
    """
    return rank_margin_loss(cos, scores, margin=0, tau=tau, method=method)


def _dense(cos: torch.Tensor, ranks: torch.Tensor, margin: float, tau: float) -> torch.Tensor:
    active = (ranks[None, :] - ranks[:, None]) > margin  # [i, j]: r_j - r_i > I
    logits = tau * (cos[:, None] - cos[None, :])
    return log1p_sum_exp(logits[active])


def _sorted(cos: torch.Tensor, scores: torch.Tensor, margin: float, tau: float) -> torch.Tensor:
    # Work in score order: one sort gives the ranks and makes every admissible j-set a suffix.
    sorted_scores, order = torch.sort(scores)
    c = cos[order]
    if 0 <= margin < 1:  # integer ranks: r_j - r_i > I  <=>  r_j > r_i  <=>  s_j > s_i (CoSENT's one search)
        first = torch.searchsorted(sorted_scores, sorted_scores, side="right")
    elif margin >= 1:  # r_j > r_i + I  <=>  r_j > r_i + floor(I), all in integers
        ranks = torch.searchsorted(sorted_scores, sorted_scores, side="left")  # 0-based competition ranks
        first = torch.searchsorted(ranks, ranks + math.floor(margin), side="right")
    else:
        ranks = torch.searchsorted(sorted_scores, sorted_scores, side="left").to(torch.float64)
        first = torch.searchsorted(ranks, ranks + margin, side="right")  # first position with r_j > r_i + I
    per_i = tau * c + suffix_logsumexp(-tau * c)[first]  # -inf where no j qualifies: adds exp(-inf) = 0
    return log1p_sum_exp(per_i)
