"""Ranked-list post-training (ranking-sentences paper): ListMLE (Eq. 5) and the refined targets
of Eq. 6-7 / Algorithm 1, with the suffix position compared against suffix ranks (the reference
code compares a suffix position with an absolute column index)."""

from __future__ import annotations

import math

import torch


def listmle_loss(pred: torch.Tensor, target: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ListMLE (ranked-lists paper Eq. 5) over rows of ``pred[R, n]``: order = ``target`` sorted descending (ties:
    lower index first); loss_row = sum_i logsumexp(p_pi(i..n)) - p_pi(i); mean over rows.

    Args:
        pred: [R, n] predicted scores (the student's cosines / tau). target: [R, n] scores giving the true order
            (the refined teacher similarities, ``refine_targets``). mask: [R, n] bool, real items of padded rows.

    Inputs (config name ``listmle``): ranked lists from ``ray_jobs/generate_lists.py`` (``posttrain`` job), each
    with its teacher matrix. Batch fields: list_emb, list_target, list_mask.

    Reference: objectives.references.RANKED_LISTS.

    Example::

        objective: {weights: {listmle: 1.0}, listmle: {omega: 0.5, tau: 0.05}}
    """
    if pred.dim() == 1:
        pred, target = pred[None], target[None]
        mask = None if mask is None else mask[None]
    if mask is None:
        mask = torch.ones_like(pred, dtype=torch.bool)
    # Padding sorts last: its target is below every real one.
    key = torch.where(mask, target, torch.full_like(target, -math.inf))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    p = torch.gather(pred, 1, order)
    m = torch.gather(mask, 1, order)
    p = torch.where(m, p, torch.full_like(p, -math.inf))
    suffix = torch.logcumsumexp(p.flip(1), dim=1).flip(1)
    terms = torch.where(m, suffix - p, torch.zeros_like(p))
    return terms.sum(dim=1).mean()


def refine_targets(phi: torch.Tensor, omega: float) -> torch.Tensor:
    """Refined similarity matrix: phi + sign(A) log(1 + omega |A|).

    Row i ranks its items k >= i by index (the true order of a ranked list); v_k is the (k-i)-th largest
    value of phi[i, i:] and A[i, k] = v_k - phi[i, k], mirrored into the lower triangle. Every similarity
    moves toward the value that its true rank position holds; a row already in order is unchanged.
    """
    n = phi.shape[-1]
    if phi.shape != (n, n):
        raise ValueError(f"phi must be a square matrix, got {tuple(phi.shape)}")
    idx = torch.arange(n, device=phi.device)
    upper = idx[None, :] >= idx[:, None]  # k >= i
    suffix_sorted = torch.sort(phi.masked_fill(~upper, -math.inf), dim=1, descending=True).values
    offset = (idx[None, :] - idx[:, None]).clamp_min(0)  # k - i
    v = torch.gather(suffix_sorted, 1, offset)
    a_upper = torch.where(upper, v - phi, torch.zeros_like(phi))
    a = a_upper + torch.triu(a_upper, diagonal=1).T
    return phi + torch.sign(a) * torch.log1p(omega * a.abs())
