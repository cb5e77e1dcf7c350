"""RAOE Gated Angular objective (Eq. 3).

L_angle = log(1 + sum_{l_i > l_j and s_i < s_j} exp(tau (theta_j - theta_i))), theta = arccos(cos).
Labels: entailment 0, neutral 1, contradiction 2 (larger = less related). The sorted form splits the
j side by label: within one label the pairs with s_j > s_i are a suffix in score order, so each
label contributes one suffix log-sum-exp; O(B log B) time, O(B) memory.
"""

from __future__ import annotations

import torch

from objectives._common import choose_form, log1p_sum_exp, safe_arccos, suffix_logsumexp


def gated_angle_loss(
    cos: torch.Tensor,
    labels: torch.Tensor,
    scores: torch.Tensor,
    *,
    tau: float = 20.0,
    method: str = "auto",
) -> torch.Tensor:
    """RAOE Gated Angular objective (Eq. 3): where the NLI label says pair i is more related than pair j
    (l_i < l_j) but its score S says less (s_i < s_j), the angle of i must still be the smaller:
    ``log(1 + sum exp(tau (theta_j - theta_i)))`` over those gated pairs, theta = arccos(cos).

    Args:
        cos: [B] pair cosines. labels: [B] NLI labels (entailment 0, neutral 1, contradiction 2).
        scores: [B] continuous similarity S. tau: scale (multiplies). method: "dense", "sorted" or "auto".

    Inputs (config name ``gated_angle``): annotated NLI pairs (``pairs`` data with labels and S).
    Batch fields: emb1, emb2, labels, scores.

    Reference: objectives.references.RAOE.

    Example::

        objective: {preset: raoe}   # rank_margin 1.0 + gated_angle 1.0
    """
    if not (cos.shape == labels.shape == scores.shape) or cos.dim() != 1:
        raise ValueError("cos, labels and scores must be 1-d tensors of equal length")
    theta = safe_arccos(cos)
    if choose_form(method, cos.numel()) == "dense":
        active = (labels[:, None] > labels[None, :]) & (scores[:, None] < scores[None, :])
        logits = tau * (theta[None, :] - theta[:, None])  # [i, j] = tau (theta_j - theta_i)
        return log1p_sum_exp(logits[active])
    terms = []
    for value in torch.unique(labels):
        members = labels == value
        s_j, order = torch.sort(scores[members])
        suffix = suffix_logsumexp(tau * theta[members][order])
        first = torch.searchsorted(s_j, scores, side="right")  # j of this label with s_j > s_i
        valid = (labels > value) & (first < s_j.numel())
        terms.append((suffix[first] - tau * theta)[valid])
    return log1p_sum_exp(torch.cat(terms))
