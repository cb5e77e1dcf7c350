"""RSE relational objective (Eq. 1-2): a relation is a translation, h_head + r_k ~ h_tail."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from objectives._common import cosine_matrix
from objectives.tiled import Exclusion, tiled_cross_entropy


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


def relational_share(
    head: torch.Tensor,
    tail: torch.Tensor,
    relation: torch.Tensor,
    relation_table: torch.Tensor,
    hard_negative: torch.Tensor | None,
    head_ids: torch.Tensor | None,
    tail_ids: torch.Tensor | None,
    negative_ids: torch.Tensor | None,
    rows: slice,
    *,
    tau: float = 0.05,
) -> torch.Tensor:
    """This worker's share of ``relational_loss``: the triples ``rows`` against every tail and hard negative of the
    global batch, in tiles (objectives.tiled), with the same false negatives left out; summed and divided by the batch
    size, so the shares of workers that split the triples among them sum to the loss."""
    batch = head.shape[0]
    queries = F.normalize(head[rows] + relation_table[relation[rows]], dim=-1)
    candidates = [F.normalize(tail, dim=-1)]
    extra = hard_negative.shape[0] if hard_negative is not None else 0
    if hard_negative is not None:
        candidates.append(F.normalize(hard_negative, dim=-1))
    none = torch.full((extra,), -1, dtype=torch.long, device=head.device)  # a key no text id equals
    exclusions = []
    if head_ids is not None and tail_ids is not None:  # the same head or the same tail text in the batch
        exclusions += [Exclusion(head_ids[rows], torch.cat([head_ids, none])),
                       Exclusion(tail_ids[rows], torch.cat([tail_ids, none]))]
    if hard_negative is not None and tail_ids is not None and negative_ids is not None:  # a negative that is tail_i
        exclusions.append(Exclusion(tail_ids[rows], torch.cat([torch.full_like(tail_ids, -1), negative_ids])))
    scales = torch.full((batch + extra,), 1.0 / tau, device=head.device)
    targets = torch.arange(rows.start, rows.stop, device=head.device)
    return tiled_cross_entropy(queries, torch.cat(candidates), scales, targets, exclusions=tuple(exclusions)).sum() / batch


def relation_scores(head: torch.Tensor, tail: torch.Tensor, relation_table: torch.Tensor) -> torch.Tensor:
    """Inference: cos(head_i + r_k, tail_i) for every relation k, [B, K]."""
    queries = head[:, None, :] + relation_table[None, :, :]
    return F.cosine_similarity(queries, tail[:, None, :], dim=-1)
