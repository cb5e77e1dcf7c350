"""InfoNCE family: supervised SimCSE InfoNCE (Gao et al. 2021) and HiNCE (SAN paper, Eq. 2).

tau divides (0.05). Cross-entropy losses return the mean over anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from objectives._common import cosine_matrix


def infonce_loss(
    anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None = None, *, tau: float = 0.05,
    negative_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Candidates of anchor i: every positive of the batch (+ every hard negative); target = its own positive."""
    return hince_loss(anchor, positive, negative, tau1=tau, tau2=tau, negative_mask=negative_mask)


def hince_loss(
    anchor: torch.Tensor,
    positive: torch.Tensor,
    aligned_negative: torch.Tensor | None,
    *,
    tau1: float = 0.05,
    tau2: float = 0.08,
    negative_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hierarchical InfoNCE: in-batch candidates at tau1, syntactically aligned negatives at tau2.

    ``negative_mask`` [B] (bool) marks the rows whose aligned negative is real: an anchor the SAN guard left without
    one keeps its place in the batch, and its placeholder row is left out of every anchor's softmax."""
    logits = cosine_matrix(anchor, positive) / tau1
    if aligned_negative is not None:
        negatives = cosine_matrix(anchor, aligned_negative) / tau2
        if negative_mask is not None:
            negatives = negatives.masked_fill(~negative_mask.bool()[None, :], float("-inf"))
        logits = torch.cat([logits, negatives], dim=1)
    targets = torch.arange(anchor.shape[0], device=anchor.device)
    return F.cross_entropy(logits, targets)
