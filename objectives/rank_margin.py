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
    """RAOE Eq. 2 on the cosines ``cos[B]`` of a batch of pairs with similarity scores ``scores[B]``."""
    if cos.shape != scores.shape or cos.dim() != 1:
        raise ValueError(f"cos and scores must be 1-d of equal length, got {tuple(cos.shape)} and {tuple(scores.shape)}")
    if choose_form(method, cos.numel()) == "dense":
        return _dense(cos, competition_rank(scores).to(torch.float64), margin, tau)
    return _sorted(cos, scores, margin, tau)


def cosent_loss(cos: torch.Tensor, scores: torch.Tensor, *, tau: float = 20.0, method: str = "auto") -> torch.Tensor:
    """CoSENT (Su 2022; AnglE Eq. 1): pairs with scores_j > scores_i, log(1 + sum exp(tau (c_i - c_j)))."""
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
