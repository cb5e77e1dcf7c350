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
    """RSE relational contrastive objective (Eq. 1-2): cos(head_i + r_{relation_i}, every tail of the batch and
    every hard negative) / tau, cross-entropy to tail_i, mean over triples.

    Args:
        head, tail: [B, d]. relation: [B] relation index. relation_table: [K, d] learned relation vectors.
        hard_negative: [B', d] or None. head_ids, tail_ids, negative_ids: text ids for false-negative masking.
        tau: temperature (divides).

    Inputs (config name ``relational``): relation triples mixed by ``data.sources`` (``ray_jobs/relational.py``).
    Batch fields: emb1, emb2, relation, relation_table, emb_neg, ids1, ids2, ids_neg.

    Reference: objectives.references.RSE.

    Example::

        objective: {weights: {relational: 1.0}, relational: {tau: 0.05}}

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
