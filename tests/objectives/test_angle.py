"""AnglE: angle objective vs sentence-transformers' AnglELoss, in-batch negatives vs a double loop."""

import math

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import AnglELoss

import reference
from objectives import angle_composite_loss, angle_ibn_loss, angle_loss, angle_similarity, cosent_loss


def embeddings(seed, n=30, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("tau", [10.0, 20.0])
@pytest.mark.parametrize("d", [16, 15])
def test_angle_loss_agrees_with_sentence_transformers(tau, d):
    e1, e2 = embeddings(1, d=d)
    scores = torch.randint(0, 6, (30,), generator=torch.Generator().manual_seed(2)).float() / 5
    want = AnglELoss(torch.nn.Identity(), scale=tau).compute_loss_from_embeddings([e1, e2], scores)
    assert angle_loss(e1, e2, scores, tau=tau).item() == pytest.approx(want.item(), abs=1e-6)


def test_angle_similarity_is_the_complex_quotient():
    e1, e2 = embeddings(3, n=5, d=8, dtype=torch.float64)
    for i in range(5):
        z = torch.complex(e1[i, :4], e1[i, 4:])
        w = torch.complex(e2[i, :4], e2[i, 4:])
        quotient = z * w.conj() / (e1[i].norm() * e2[i].norm())  # (z / w) scaled by |w|^2 / (|z||w|)
        want = abs(quotient.real.sum() + quotient.imag.sum())
        assert angle_similarity(e1[i : i + 1], e2[i : i + 1]).item() == pytest.approx(want.item(), rel=1e-12)


def test_in_batch_negatives_equal_double_loop_with_duplicates_and_graded_labels():
    e1, e2 = embeddings(4, n=12, d=8, dtype=torch.float64)
    # graded labels: only pairs labelled positive are anchors (no integer cast of 0.6 -> 0 or 1)
    graded = torch.tensor([1.0, 0.6, 1.0, 0.0, 1.0, 0.8, 1.0, 0.2, 1.0, 1.0, 0.4, 1.0])
    positive = graded >= 1.0
    ids1 = torch.tensor([1, 2, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # text 1 repeated (rows 0 and 2)
    ids2 = torch.tensor([20, 21, 22, 23, 20, 25, 26, 27, 28, 29, 30, 31])  # positive text 20 repeated
    got = angle_ibn_loss(e1, e2, positive, tau=20.0, ids1=ids1, ids2=ids2)
    want = reference.angle_ibn(e1.numpy(), e2.numpy(), positive.tolist(), ids1.tolist(), ids2.tolist(), 20.0)
    assert got.item() == pytest.approx(want, rel=1e-12)
    plain = angle_ibn_loss(e1, e2, positive, tau=20.0)
    assert plain.item() != pytest.approx(got.item())  # duplicates change the value


def test_a_swapped_duplicate_pair_is_not_a_negative():
    """(a, b) and (b, a) in one batch: the candidate b->a of anchor a is the anchor's own text (cosine 1 with
    itself in a trained model), never a negative. Equal to the loss over the batch without that candidate."""
    e1, e2 = embeddings(6, n=6, d=8, dtype=torch.float64)
    e1[3], e2[3] = e2[0], e1[0]  # row 3 = (b, a), row 0 = (a, b)
    ids1, ids2 = torch.tensor([1, 2, 3, 20, 5, 6]), torch.tensor([20, 21, 22, 1, 24, 25])
    positive = torch.ones(6, dtype=torch.bool)
    got = angle_ibn_loss(e1, e2, positive, tau=20.0, ids1=ids1, ids2=ids2)
    want = reference.angle_ibn(e1.numpy(), e2.numpy(), positive.tolist(), ids1.tolist(), ids2.tolist(), 20.0)
    assert got.item() == pytest.approx(want, rel=1e-12)
    logits = 20.0 * torch.nn.functional.normalize(e1, dim=1) @ torch.nn.functional.normalize(e2, dim=1).T
    logits[0, 3] = logits[3, 0] = float("-inf")  # a's candidate 'a' and b's candidate 'b' left out
    assert got.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.arange(6)).item(), rel=1e-12)


def test_in_batch_negatives_without_positives_is_zero_with_gradient():
    e1, e2 = embeddings(5, n=4)
    e1.requires_grad_()
    loss = angle_ibn_loss(e1, e2, torch.zeros(4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(e1.grad).all()


def test_composite_is_the_weighted_sum():
    e1, e2 = embeddings(6, n=10, dtype=torch.float64)
    scores = torch.rand(10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positive = scores > 0.5
    cos = torch.nn.functional.cosine_similarity(e1, e2)
    want = (
        0.5 * cosent_loss(cos, scores)
        + 2.0 * angle_ibn_loss(e1, e2, positive)
        + 3.0 * angle_loss(e1, e2, scores)
    )
    got = angle_composite_loss(e1, e2, scores, positive, w_cosine=0.5, w_ibn=2.0, w_angle=3.0)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)


def test_gradcheck_angle_objectives():
    e1, e2 = embeddings(7, n=6, d=6, dtype=torch.float64)
    e1.requires_grad_()
    scores = torch.tensor([0.0, 0.2, 0.2, 0.5, 0.9, 1.0], dtype=torch.float64)
    positive = scores >= 0.5
    assert torch.autograd.gradcheck(lambda x: angle_loss(x, e2, scores, tau=2.0), (e1,))
    assert torch.autograd.gradcheck(lambda x: angle_ibn_loss(x, e2, positive, tau=2.0), (e1,))
    assert math.isfinite(angle_loss(e1, e1.detach(), scores).item())
