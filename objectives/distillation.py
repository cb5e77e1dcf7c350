"""Distillation from teacher scores over each query's own candidates (query groups: its positive and the
negatives drawn for it this step, scores stored with the group by the mining or annotate job).

Both losses are per query, O(batch x group): every worker computes the gathered batch's value / N
(CompositeObjective), like the rank losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_scores(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor, *,
                 cosine: bool = True) -> torch.Tensor:
    """[B, 1 + k] scores of each query against its positive (column 0) and its own k negatives (row-major: query i's
    negatives are rows i*k .. i*k+k-1 of ``negatives``), by cosine or by dot product."""
    batch, dim = query.shape
    if negatives.shape[0] % batch:
        raise ValueError(f"{negatives.shape[0]} negatives do not split evenly over {batch} queries")
    candidates = torch.cat([positive[:, None], negatives.view(batch, -1, dim)], dim=1)
    if cosine:
        query, candidates = F.normalize(query, dim=-1), F.normalize(candidates, dim=-1)
    return torch.einsum("bd,bkd->bk", query, candidates)


def distill_kl_loss(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor,
                    teacher_scores: torch.Tensor, *, tau: float = 0.05, teacher_tau: float = 1.0) -> torch.Tensor:
    """Listwise distillation: KL(teacher || student) of each query's distribution over its candidates, the mean over
    queries. Student: cosine / ``tau``; teacher: its scores / ``teacher_tau`` (1 for a cross-encoder's logits; about
    0.05 for a bi-encoder's cosines).

    Args:
        query, positive: [B, d]. negatives: [B x k, d], each query's k negatives in turn.
        teacher_scores: [B, 1 + k], the positive's first, then its negatives' in the same order.
        tau, teacher_tau: temperatures (divide).

    Inputs (config name ``distill_kl``): query groups with teacher scores (``data.format: groups_jsonl`` with
    ``positive_scores`` / ``negative_scores``: ray_jobs/mine_negatives.py or ray_jobs/annotate.py write them).
    Batch fields: emb1, emb2, emb_neg, teacher_scores.

    Reference: objectives.references.ROCKETQA_V2.

    Example::

        objective: {weights: {infonce: 1.0, distill_kl: 1.0}, distill_kl: {tau: 0.05, teacher_tau: 1.0}}
    """
    student = group_scores(query, positive, negatives) / tau
    teacher = F.softmax(teacher_scores.to(student.dtype) / teacher_tau, dim=-1)
    return F.kl_div(F.log_softmax(student, dim=-1), teacher, reduction="batchmean")


def margin_mse_loss(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor,
                    teacher_scores: torch.Tensor, *, similarity: str = "dot") -> torch.Tensor:
    """MarginMSE: for each (query, positive, negative) of a group, the squared error between the student's margin
    s(q, p) - s(q, n) and the teacher's, the mean over every negative of every query.

    Args:
        query, positive, negatives, teacher_scores: as ``distill_kl_loss``.
        similarity: ``dot`` (the paper's and sentence-transformers' MarginMSELoss) or ``cosine``.

    Inputs (config name ``margin_mse``): query groups with teacher scores. Batch fields: emb1, emb2, emb_neg,
    teacher_scores.

    Reference: objectives.references.MARGIN_MSE.

    Example::

        objective: {weights: {margin_mse: 1.0}, margin_mse: {similarity: dot}}
    """
    if similarity not in ("dot", "cosine"):
        raise ValueError(f"margin_mse.similarity must be dot or cosine, got {similarity!r}")
    student = group_scores(query, positive, negatives, cosine=similarity == "cosine")
    teacher = teacher_scores.to(student.dtype)
    return F.mse_loss(student[:, :1] - student[:, 1:], teacher[:, :1] - teacher[:, 1:])
