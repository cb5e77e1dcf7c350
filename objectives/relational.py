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
    head_ids: torch.Tensor | None = None,
    tail_ids: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
    *,
    tau: float = 0.05,
) -> torch.Tensor:
    """cos(head_i + relation_table[relation_i], tails (+ hard negatives)) / tau, cross-entropy to tail_i, mean.

    With text ids, false negatives leave row i's denominator: another triple's tail when that triple has the same
    head (the same anchor twice in a batch) or the same tail text, and any hard negative whose text is tail_i."""
    query = head + relation_table[relation]
    logits = cosine_matrix(query, tail) / tau
    if head_ids is not None and tail_ids is not None:
        same = (head_ids[:, None] == head_ids[None, :]) | (tail_ids[:, None] == tail_ids[None, :])
        same.fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
    if hard_negative is not None:
        negative_logits = cosine_matrix(query, hard_negative) / tau
        if tail_ids is not None and negative_ids is not None:
            negative_logits = negative_logits.masked_fill(tail_ids[:, None] == negative_ids[None, :], float("-inf"))
        logits = torch.cat([logits, negative_logits], dim=1)
    targets = torch.arange(head.shape[0], device=head.device)
    return F.cross_entropy(logits, targets)


def relation_scores(head: torch.Tensor, tail: torch.Tensor, relation_table: torch.Tensor) -> torch.Tensor:
    """Inference: cos(head_i + r_k, tail_i) for every relation k, [B, K]."""
    queries = head[:, None, :] + relation_table[None, :, :]
    return F.cosine_similarity(queries, tail[:, None, :], dim=-1)
