"""InfoNCE family: supervised SimCSE InfoNCE (Gao et al. 2021) and HiNCE (SAN paper, Eq. 2).

tau divides (0.05). Cross-entropy losses return the mean over anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from objectives._common import cosine_matrix
from objectives.tiled import Exclusion, tiled_cross_entropy


def infonce_loss(
    anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None = None, *, tau: float = 0.05,
    negative_mask: torch.Tensor | None = None, anchor_ids: torch.Tensor | None = None,
    positive_ids: torch.Tensor | None = None, negative_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Supervised SimCSE InfoNCE: anchor i against every positive of the global batch (and every hard negative),
    cross-entropy to its own positive; cosines divided by ``tau``.

    Args:
        anchor, positive: [B, d]. negative: [B', d] hard negatives (B' = B for triplets, B x (group_size - 1) for
            query groups), or None (in-batch candidates only); every anchor meets every one.
        tau: temperature (divides). negative_mask: [B'] bool, the hard negatives that are real.
        anchor_ids, positive_ids, negative_ids: text ids ([B], [B], [B']) for false-negative masking.

    With text ids, false negatives leave anchor i's softmax: another row's positive when that row has the same anchor
    text (a query with several positives, or a mined pair repeated with each of its negatives) or the same positive
    text, and any hard negative whose text is positive_i.

    Inputs (config name ``infonce``): SimCSE triplets (``data.triplets: true`` on NLI), query groups (``data.format:
    groups_jsonl``: each query's group_size - 1 negatives), pairs, or sentences (unsupervised SimCSE: the two dropout
    views are anchor and positive). Batch fields: emb1, emb2, emb_neg.

    Reference: objectives.references.SIMCSE.

    Example::

        objective: {weights: {infonce: 1.0}, infonce: {tau: 0.05}}
    """
    return hince_loss(anchor, positive, negative, tau1=tau, tau2=tau, negative_mask=negative_mask,
                      anchor_ids=anchor_ids, positive_ids=positive_ids, negative_ids=negative_ids)


def hince_loss(
    anchor: torch.Tensor,
    positive: torch.Tensor,
    aligned_negative: torch.Tensor | None,
    *,
    tau1: float = 0.05,
    tau2: float = 0.08,
    negative_mask: torch.Tensor | None = None,
    anchor_ids: torch.Tensor | None = None,
    positive_ids: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hierarchical InfoNCE (HiNCE, SAN paper Eq. 2): in-batch candidates at temperature tau1, syntactically aligned
    negatives at tau2, in one softmax per anchor.

    Args:
        anchor, positive: [B, d] (unsupervised: two dropout views of each sentence).
        aligned_negative: [B, d] SAN negatives, each encoded at dropout ``model.negative_dropout`` (p2).
        tau1, tau2: temperatures (divide). negative_mask: [B] bool, the rows whose aligned negative is real: an
            anchor the SAN guard left without one keeps its place, its placeholder out of every softmax.

    Inputs (config name ``hince``): sentences with a ``negative`` column from ``ray_jobs/generate_san.py``.
    Batch fields: emb1, emb2, emb_neg, neg_mask.

    Reference: objectives.references.SAN.

    Example::

        objective: {weights: {hince: 1.0}, hince: {tau1: 0.05, tau2: 0.08}}
    """
    logits = cosine_matrix(anchor, positive) / tau1
    if anchor_ids is not None and positive_ids is not None:  # (infonce_loss's false negatives)
        same = (anchor_ids[:, None] == anchor_ids[None, :]) | (positive_ids[:, None] == positive_ids[None, :])
        same.fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
    if aligned_negative is not None:
        negatives = cosine_matrix(anchor, aligned_negative) / tau2
        if negative_mask is not None:
            negatives = negatives.masked_fill(~negative_mask.bool()[None, :], float("-inf"))
        if positive_ids is not None and negative_ids is not None:
            negatives = negatives.masked_fill(positive_ids[:, None] == negative_ids[None, :], float("-inf"))
        logits = torch.cat([logits, negatives], dim=1)
    targets = torch.arange(anchor.shape[0], device=anchor.device)
    return F.cross_entropy(logits, targets)


def hince_share(
    anchor: torch.Tensor,
    positive: torch.Tensor,
    aligned_negative: torch.Tensor | None,
    rows: slice,
    *,
    tau1: float = 0.05,
    tau2: float = 0.08,
    negative_mask: torch.Tensor | None = None,
    anchor_ids: torch.Tensor | None = None,
    positive_ids: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """This worker's share of ``hince_loss`` (and of ``infonce_loss``: tau1 = tau2): the anchors ``rows`` of the
    global batch against every candidate, in tiles (objectives.tiled), summed and divided by the batch size. The
    shares of workers that split the anchors among them sum to the loss, value and gradient."""
    batch = anchor.shape[0]
    candidates = [F.normalize(positive, dim=-1)]
    scales = [torch.full((batch,), 1.0 / tau1, device=anchor.device)]
    valid = [torch.ones(batch, dtype=torch.bool, device=anchor.device)]
    if aligned_negative is not None:
        candidates.append(F.normalize(aligned_negative, dim=-1))
        scales.append(torch.full((aligned_negative.shape[0],), 1.0 / tau2, device=anchor.device))
        valid.append(negative_mask.bool() if negative_mask is not None
                     else torch.ones(aligned_negative.shape[0], dtype=torch.bool, device=anchor.device))
    targets = torch.arange(rows.start, rows.stop, device=anchor.device)
    extra = aligned_negative.shape[0] if aligned_negative is not None else 0
    none = torch.full((extra,), -1, dtype=torch.long, device=anchor.device)  # a key no text id equals
    exclusions = []
    if anchor_ids is not None and positive_ids is not None:  # the same anchor or the same positive text
        exclusions += [Exclusion(anchor_ids[rows], torch.cat([anchor_ids, none])),
                       Exclusion(positive_ids[rows], torch.cat([positive_ids, none]))]
    if aligned_negative is not None and positive_ids is not None and negative_ids is not None:
        exclusions.append(Exclusion(positive_ids[rows], torch.cat([torch.full_like(positive_ids, -1), negative_ids])))
    losses = tiled_cross_entropy(F.normalize(anchor[rows], dim=-1), torch.cat(candidates), torch.cat(scales), targets,
                                 torch.cat(valid), exclusions=tuple(exclusions))
    return losses.sum() / batch
