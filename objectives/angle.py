"""AnglE objectives (Li & Li 2024): cosine (CoSENT, Eq. 1), in-batch negatives (Eq. 2) and the
complex-space angle objective (Eq. 4-7). Scale convention as sentence-transformers: tau multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from objectives._common import cosine_matrix, pair_cosine
from objectives.rank_margin import cosent_loss
from objectives.tiled import Exclusion, tiled_cross_entropy


def angle_similarity(e1: torch.Tensor, e2: torch.Tensor) -> torch.Tensor:
    """|Re + Im| of the normalised complex quotient z/w summed over dimensions (AnglE Eq. 4-6).

    Each embedding is split into a real half (a, c) and an imaginary half (b, d); after dividing by the
    moduli of the two embeddings, sum(Re) = cos(e1, e2) and sum(Im) = sum(b c - a d). Normalised per pair,
    as in sentence-transformers' ``pairwise_angle_sim`` (older reference code normalised over the batch
    axis, which made a pair's value depend on the rest of the batch). Odd dimensions are zero-padded.
    """
    if e1.shape[1] % 2:
        e1, e2 = F.pad(e1, (0, 1)), F.pad(e2, (0, 1))
    x, y = F.normalize(e1, dim=1), F.normalize(e2, dim=1)
    a, b = torch.chunk(x, 2, dim=1)
    c, d = torch.chunk(y, 2, dim=1)
    re = torch.sum(a * c + b * d, dim=1)
    im = torch.sum(b * c - a * d, dim=1)
    return torch.abs(re + im)


def angle_loss(
    e1: torch.Tensor, e2: torch.Tensor, scores: torch.Tensor, *, tau: float = 20.0, method: str = "auto"
) -> torch.Tensor:
    """AnglE's angle objective (Eq. 7): the CoSENT ranking applied to the complex-space angle similarity
    (``angle_similarity``), which keeps a gradient where the cosine saturates.

    Args:
        e1, e2: [B, d] embeddings of each pair's two texts (an odd d is zero-padded).
        scores: [B] gold similarity. tau: scale (multiplies). method: "dense", "sorted" or "auto".

    Inputs (config name ``angle``): STS or annotated NLI pairs. Batch fields: emb1, emb2, scores.

    Reference: objectives.references.ANGLE.

    Example::

        objective: {preset: angle}   # cosent + angle_ibn + angle, AnglE Eq. 8
    """
    return cosent_loss(angle_similarity(e1, e2), scores, tau=tau, method=method)


def angle_ibn_loss(
    e1: torch.Tensor,
    e2: torch.Tensor,
    positive: torch.Tensor,
    *,
    tau: float = 20.0,
    ids1: torch.Tensor | None = None,
    ids2: torch.Tensor | None = None,
) -> torch.Tensor:
    """AnglE in-batch negatives (Eq. 2) with supervised positives, mean over the positive anchors.

    Args:
        e1, e2: [B, d] embeddings of each pair's texts. positive: [B] bool, the pairs that are positives.
        tau: scale (multiplies). ids1, ids2: [B] text ids, to keep duplicates out of the denominators.

    Inputs (config name ``angle_ibn``): pairs whose positives come from NLI labels (entailment), else from
    S >= ``positive_threshold``. Batch fields: emb1, emb2, labels or scores, ids1, ids2.

    Reference: objectives.references.ANGLE.

    Example::

        objective: {weights: {cosent: 1.0, angle_ibn: 1.0}, angle_ibn: {tau: 20.0, positive_threshold: 0.8}}

    ``positive[B]`` (bool) marks the pairs labelled as positives; only they are anchors, and for a
    graded label the caller decides what counts as positive (no integer cast of scores). The
    candidates of anchor i are all second sentences of the batch. A candidate j != i whose text is
    the anchor's own positive text (``ids2[j] == ids2[i]``), the anchor's own text (``ids2[j] ==
    ids1[i]``: a swapped duplicate pair (b, a) of (a, b)), or the positive of an anchor with the
    same text (``ids1[j] == ids1[i]`` and ``positive[j]``), is not a negative: it is left out of the
    denominator, so duplicates never push identical sentences apart. ``ids*`` are integer
    text ids (e.g. hashes); without them no duplicates are assumed.
    """
    positive = positive.bool()
    if not bool(positive.any()):
        return e1.sum() * 0.0
    logits = tau * cosine_matrix(e1, e2)  # [anchor i, candidate j]
    n = logits.shape[0]
    duplicate = torch.zeros(n, n, dtype=torch.bool, device=logits.device)
    if ids2 is not None:
        duplicate |= ids2[:, None] == ids2[None, :]
    if ids1 is not None and ids2 is not None:
        duplicate |= ids1[:, None] == ids2[None, :]
    if ids1 is not None:
        duplicate |= (ids1[:, None] == ids1[None, :]) & positive[None, :]
    duplicate.fill_diagonal_(False)
    logits = logits.masked_fill(duplicate, float("-inf"))
    targets = torch.arange(n, device=logits.device)
    return F.cross_entropy(logits[positive], targets[positive])


def angle_ibn_share(
    e1: torch.Tensor,
    e2: torch.Tensor,
    positive: torch.Tensor,
    rows: slice,
    *,
    tau: float = 20.0,
    ids1: torch.Tensor | None = None,
    ids2: torch.Tensor | None = None,
) -> torch.Tensor:
    """This worker's share of ``angle_ibn_loss``: the positive anchors among ``rows`` against every second sentence of
    the global batch, in tiles (objectives.tiled), with the same duplicates left out; summed and divided by the
    number of positive anchors in the whole batch, so the shares of workers that split the rows sum to the loss."""
    positive = positive.bool()
    if not bool(positive.any()):
        return e1.sum() * 0.0
    anchors = torch.arange(rows.start, rows.stop, device=e1.device)[positive[rows]]
    exclusions = []
    if ids2 is not None:
        exclusions.append(Exclusion(ids2[anchors], ids2))  # the anchor's own positive text
    if ids1 is not None and ids2 is not None:
        exclusions.append(Exclusion(ids1[anchors], ids2))  # the anchor's own text: a swapped duplicate pair
    if ids1 is not None:
        exclusions.append(Exclusion(ids1[anchors], ids1, positive))  # the positive of an anchor with the same text
    scales = torch.full((e2.shape[0],), float(tau), device=e1.device)
    losses = tiled_cross_entropy(F.normalize(e1[anchors], dim=-1), F.normalize(e2, dim=-1), scales, anchors,
                                 exclusions=tuple(exclusions))
    return losses.sum() / positive.sum()


def angle_composite_loss(
    e1: torch.Tensor,
    e2: torch.Tensor,
    scores: torch.Tensor,
    positive: torch.Tensor,
    *,
    w_cosine: float = 1.0,
    w_ibn: float = 1.0,
    w_angle: float = 1.0,
    tau_cosine: float = 20.0,
    tau_ibn: float = 20.0,
    tau_angle: float = 20.0,
    ids1: torch.Tensor | None = None,
    ids2: torch.Tensor | None = None,
) -> torch.Tensor:
    """AnglE Eq. 8: w1 L_cos + w2 L_ibn + w3 L_angle."""
    cos = pair_cosine(e1, e2)
    return (
        w_cosine * cosent_loss(cos, scores, tau=tau_cosine)
        + w_ibn * angle_ibn_loss(e1, e2, positive, tau=tau_ibn, ids1=ids1, ids2=ids2)
        + w_angle * angle_loss(e1, e2, scores, tau=tau_angle)
    )
