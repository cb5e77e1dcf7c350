"""Distillation from teacher scores over each query's group: the losses written out by hand, their fixed points and
the order in which a group's scores line up with its candidates."""

import pytest
import torch
import torch.nn.functional as F

from objectives.distillation import distill_kl_loss, group_scores, margin_mse_loss

B, K, D = 5, 3, 6


def _group(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, p = torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, D, generator=g, dtype=torch.float64)
    n = torch.randn(B * K, D, generator=g, dtype=torch.float64)
    return q, p, n, torch.randn(B, 1 + K, generator=g, dtype=torch.float64)


def test_group_scores_pair_each_query_with_its_own_candidates():
    q, p, n, _ = _group()
    scores = group_scores(q, p, n)
    for i in range(B):
        assert scores[i, 0].item() == pytest.approx(F.cosine_similarity(q[i], p[i], dim=0).item(), rel=1e-12)
        for j in range(K):
            assert scores[i, 1 + j].item() == pytest.approx(F.cosine_similarity(q[i], n[i * K + j], dim=0).item())
    assert torch.allclose(group_scores(q, p, n, cosine=False)[:, 0], (q * p).sum(-1))
    with pytest.raises(ValueError, match="do not split evenly"):
        group_scores(q, p, n[:-1])


def test_kl_distillation_is_the_kl_of_the_teachers_softmax_to_the_students():
    q, p, n, teacher = _group()
    got = distill_kl_loss(q, p, n, teacher, tau=0.05, teacher_tau=2.0)
    want = 0.0
    for i in range(B):
        cands = torch.cat([p[i:i + 1], n[i * K:(i + 1) * K]])
        s = torch.log_softmax(F.cosine_similarity(q[i:i + 1], cands) / 0.05, dim=0)
        t = torch.softmax(teacher[i] / 2.0, dim=0)
        want += float((t * (t.log() - s)).sum()) / B
    assert got.item() == pytest.approx(want, rel=1e-10)
    matched = group_scores(q, p, n) / 0.05  # a teacher scoring as the student does: nothing to learn
    assert distill_kl_loss(q, p, n, matched, tau=0.05, teacher_tau=1.0).item() == pytest.approx(0.0, abs=1e-12)


def test_margin_mse_matches_the_margins_of_every_negative():
    q, p, n, teacher = _group()
    got = margin_mse_loss(q, p, n, teacher)
    errors = [((q[i] @ p[i] - q[i] @ n[i * K + j]) - (teacher[i, 0] - teacher[i, 1 + j])) ** 2
              for i in range(B) for j in range(K)]
    assert got.item() == pytest.approx(float(sum(errors) / len(errors)), rel=1e-10)
    shifted = teacher + 3.0  # margins only: a constant shift of the teacher's scores changes nothing
    assert margin_mse_loss(q, p, n, shifted).item() == pytest.approx(got.item(), rel=1e-10)
    assert margin_mse_loss(q, p, n, teacher, similarity="cosine").item() != pytest.approx(got.item())
    with pytest.raises(ValueError, match="dot or cosine"):
        margin_mse_loss(q, p, n, teacher, similarity="l2")


def test_missing_teacher_scores_are_refused_by_name():
    from objectives.composite import CompositeObjective, EmbeddingBatch

    q, p, n, teacher = _group()
    teacher[1, 2] = float("nan")
    with pytest.raises(ValueError, match="teacher scores in this batch are missing"):
        CompositeObjective({"distill_kl": 1.0})(EmbeddingBatch(emb1=q, emb2=p, emb_neg=n, teacher_scores=teacher))
