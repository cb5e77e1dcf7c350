"""RSE relational objective (Eq. 1-2): a relation is a translation, h_head + r_k ~ h_tail."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from objectives._common import cosine_matrix


def relational_loss(
    head: torch.Tensor,
    tail: torch.Tensor,
    relation: torch.Tensor,
    relation_table: torch.Tensor,
    hard_negative: torch.Tensor | None = None,
    *,
    tau: float = 0.05,
) -> torch.Tensor:
    """cos(head_i + relation_table[relation_i], tails (+ hard negatives)) / tau, cross-entropy to tail_i, mean."""
    query = head + relation_table[relation]
    logits = cosine_matrix(query, tail) / tau
    if hard_negative is not None:
        logits = torch.cat([logits, cosine_matrix(query, hard_negative) / tau], dim=1)
    targets = torch.arange(head.shape[0], device=head.device)
    return F.cross_entropy(logits, targets)


def relation_scores(head: torch.Tensor, tail: torch.Tensor, relation_table: torch.Tensor) -> torch.Tensor:
    """Inference: cos(head_i + r_k, tail_i) for every relation k, [B, K]."""
    queries = head[:, None, :] + relation_table[None, :, :]
    return F.cosine_similarity(queries, tail[:, None, :], dim=-1)
