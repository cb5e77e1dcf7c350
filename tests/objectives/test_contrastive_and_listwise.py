"""InfoNCE / HiNCE vs MultipleNegativesRankingLoss and a double loop; ListMLE, refined targets and RSE."""

import numpy as np
import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

import reference
from objectives import (
    hince_loss,
    infonce_loss,
    listmle_loss,
    refine_targets,
    relation_scores,
    relational_loss,
)


def tensors(seed, *shapes, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("with_negatives", [False, True])
def test_infonce_agrees_with_multiple_negatives_ranking_loss(with_negatives):
    a, p, n = tensors(0, (16, 12), (16, 12), (16, 12), dtype=torch.float32)
    mnrl = MultipleNegativesRankingLoss(torch.nn.Identity(), scale=20.0)
    want = mnrl.compute_loss_from_embeddings([a, p, n] if with_negatives else [a, p], None)
    got = infonce_loss(a, p, n if with_negatives else None, tau=0.05)
    assert got.item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize("tau1,tau2", [(0.05, 0.08), (0.05, 0.05), (0.1, 0.03)])
def test_hince_equals_double_loop(tau1, tau2):
    a, p, n = tensors(1, (9, 7), (9, 7), (9, 7))
    got = hince_loss(a, p, n, tau1=tau1, tau2=tau2)
    assert got.item() == pytest.approx(reference.hince(a.numpy(), p.numpy(), n.numpy(), tau1, tau2), rel=1e-12)
    if tau1 == tau2:
        assert got.item() == pytest.approx(infonce_loss(a, p, n, tau=tau1).item(), rel=1e-12)


def test_listmle_equals_double_loop_with_ties():
    (pred,) = tensors(2, (4, 7))
    target = torch.tensor([[3, 1, 1, 0, 2, 2, 5]] * 2 + [[0, 0, 0, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 0]]).double()
    got = listmle_loss(pred, target)
    assert got.item() == pytest.approx(reference.listmle(pred.tolist(), target.tolist()), rel=1e-12)


def test_listmle_mask_equals_the_unpadded_list():
    (pred,) = tensors(3, (1, 6))
    target = torch.tensor([[5.0, 4.0, 3.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True, False, False]])
    got = listmle_loss(pred, target, mask=mask)
    assert got.item() == pytest.approx(listmle_loss(pred[:, :4], target[:, :4]).item(), rel=1e-12)


def test_refine_targets_equals_algorithm_1():
    (x,) = tensors(4, (6, 5))
    x = torch.nn.functional.normalize(x, dim=1)
    phi = x @ x.T
    for omega in (0.5, 0.7, 2.0):
        got = refine_targets(phi, omega)
        np.testing.assert_allclose(got.numpy(), reference.refine(phi.tolist(), omega), rtol=1e-12, atol=1e-12)


def test_refine_targets_leaves_an_ordered_list_unchanged():
    n = 6
    idx = torch.arange(n, dtype=torch.float64)
    phi = 1.0 - 0.1 * (idx[:, None] - idx[None, :]).abs()  # similarity decreases with rank distance
    assert torch.equal(refine_targets(phi, 0.5), phi)


def test_relational_equals_double_loop_and_scores_pick_the_relation():
    head, tail, neg, table = tensors(5, (8, 6), (8, 6), (8, 6), (3, 6))
    rel = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    for hard in (None, neg):
        got = relational_loss(head, tail, rel, table, hard, tau=0.05)
        want = reference.relational(
            head.numpy(), tail.numpy(), rel.tolist(), table.numpy(), None if hard is None else hard.numpy(), 0.05
        )
        assert got.item() == pytest.approx(want, rel=1e-12)
    exact_tail = head + table[rel]
    assert relation_scores(head, exact_tail, table).argmax(dim=1).tolist() == rel.tolist()


def test_relational_keeps_the_same_anchor_and_the_positive_out_of_the_denominator():
    """RSE's released batches can hold the same anchor twice (its other tail then counts as a negative) and a random
    in-relation negative can be the positive itself: with text ids both leave row i's denominator."""
    head, tail, neg, table = tensors(7, (6, 5), (6, 5), (6, 5), (2, 5))
    rel = torch.tensor([0, 1, 0, 1, 0, 1])
    head_ids = torch.tensor([10, 10, 11, 12, 13, 14])  # rows 0 and 1: the same anchor
    tail_ids = torch.tensor([20, 21, 22, 23, 24, 22])  # rows 2 and 5: the same tail text
    neg_ids = torch.tensor([30, 20, 31, 32, 33, 34])  # row 1's negative is row 0's tail
    got = relational_loss(head, tail, rel, table, neg, head_ids, tail_ids, neg_ids, tau=0.5)
    want = reference.relational(head.numpy(), tail.numpy(), rel.tolist(), table.numpy(), neg.numpy(), 0.5,
                                head_ids.tolist(), tail_ids.tolist(), neg_ids.tolist())
    assert got.item() == pytest.approx(want, rel=1e-12)
    unmasked = relational_loss(head, tail, rel, table, neg, tau=0.5)
    assert abs(got.item() - unmasked.item()) > 1e-2  # the masks change the loss


def test_gradcheck_cross_entropy_objectives():
    a, p, n, table = tensors(6, (5, 4), (5, 4), (5, 4), (2, 4))
    a.requires_grad_()
    rel = torch.tensor([0, 1, 0, 1, 1])
    assert torch.autograd.gradcheck(lambda x: hince_loss(x, p, n, tau1=0.5, tau2=0.8), (a,))
    assert torch.autograd.gradcheck(lambda x: relational_loss(x, p, rel, table, n, tau=0.5), (a,))
    target = torch.tensor([[3.0, 2.0, 2.0, 0.0]] * 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: listmle_loss(x, target), (a,))


def test_hince_leaves_missing_aligned_negatives_out_of_every_softmax():
    """Anchors the SAN guard left without a negative train with a placeholder row that no softmax sees."""
    anchor, positive, negative = tensors(7, (5, 6), (5, 6), (5, 6))
    mask = torch.tensor([True, False, True, True, False])
    tau1, tau2 = 0.05, 0.08
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    want = []
    for i in range(5):
        logits = [cos(anchor[i], positive[j]) / tau1 for j in range(5)]
        logits += [cos(anchor[i], negative[j]) / tau2 for j in range(5) if mask[j]]
        want.append(-logits[i] + np.log(np.sum(np.exp(logits))))
    got = hince_loss(anchor, positive, negative, tau1=tau1, tau2=tau2, negative_mask=mask)
    assert got.item() == pytest.approx(np.mean(want), rel=1e-12)
    everything = hince_loss(anchor, positive, negative, tau1=tau1, tau2=tau2)
    assert everything.item() != pytest.approx(got.item(), rel=1e-3)  # the placeholders would count otherwise
    all_real = hince_loss(anchor, positive, negative, tau1=tau1, tau2=tau2, negative_mask=torch.ones(5, dtype=torch.bool))
    assert all_real.item() == pytest.approx(everything.item(), rel=1e-12)
