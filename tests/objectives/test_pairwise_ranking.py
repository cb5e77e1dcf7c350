"""rank_margin, cosent and gated_angle against float64 double loops, in both forms, and against
sentence-transformers' CoSENTLoss."""

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import CoSENTLoss

import reference
from objectives import cosent_loss, gated_angle_loss, rank_margin_loss
from objectives._common import competition_rank


def random_batch(seed, n=24, levels=6):
    g = torch.Generator().manual_seed(seed)
    cos = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    scores = torch.randint(0, levels, (n,), generator=g).double() / (levels - 1)  # many ties
    labels = torch.randint(0, 3, (n,), generator=g)
    return cos, scores, labels


def test_competition_rank_matches_scipy_min():
    from scipy.stats import rankdata

    _, scores, _ = random_batch(0, n=50, levels=7)
    assert competition_rank(scores).tolist() == rankdata(scores.numpy(), method="min").tolist()


@pytest.mark.parametrize("method", ["dense", "sorted"])
@pytest.mark.parametrize("margin", [-1.5, 0, 0.5, 1, 2, 3.5, 10])
@pytest.mark.parametrize("tau", [1.0, 5.0, 20.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_rank_margin_equals_double_loop(method, margin, tau, seed):
    cos, scores, _ = random_batch(seed)
    got = rank_margin_loss(cos, scores, margin=margin, tau=tau, method=method)
    want = reference.rank_margin(cos.tolist(), scores.numpy(), margin, tau)
    assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("method", ["dense", "sorted"])
@pytest.mark.parametrize("tau", [1.0, 20.0])
def test_cosent_is_margin_zero_and_equals_double_loop(method, tau):
    cos, scores, _ = random_batch(3)
    got = cosent_loss(cos, scores, tau=tau, method=method)
    assert got.item() == pytest.approx(reference.cosent(cos.tolist(), scores.tolist(), tau), rel=1e-12)
    assert got.item() == pytest.approx(rank_margin_loss(cos, scores, margin=0, tau=tau, method=method).item())


@pytest.mark.parametrize("method", ["dense", "sorted"])
@pytest.mark.parametrize("tau", [1.0, 5.0, 20.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gated_angle_equals_double_loop(method, tau, seed):
    cos, scores, labels = random_batch(seed)
    got = gated_angle_loss(cos, labels, scores, tau=tau, method=method)
    want = reference.gated_angle(cos.tolist(), labels.tolist(), scores.tolist(), tau)
    assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_gated_angle_with_a_single_label_has_no_pairs():
    cos, scores, _ = random_batch(4)
    labels = torch.ones_like(scores, dtype=torch.long)
    for method in ("dense", "sorted"):
        assert gated_angle_loss(cos, labels, scores, method=method).item() == 0.0


@pytest.mark.parametrize("tau", [10.0, 20.0])
def test_cosent_agrees_with_sentence_transformers(tau):
    g = torch.Generator().manual_seed(7)
    e1, e2 = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    scores = torch.randint(0, 5, (40,), generator=g).float() / 4
    st = CoSENTLoss(torch.nn.Identity(), scale=tau)  # only the embedding-level method is used
    want = st.compute_loss_from_embeddings([e1, e2], scores)
    cos = torch.nn.functional.cosine_similarity(e1, e2)
    for method in ("dense", "sorted"):
        assert cosent_loss(cos, scores, tau=tau, method=method).item() == pytest.approx(want.item(), abs=1e-6)


def test_dense_and_sorted_forms_agree_on_a_large_batch():
    g = torch.Generator().manual_seed(11)
    n = 3000
    cos = torch.rand(n, generator=g) * 2 - 1
    scores = torch.randint(0, 200, (n,), generator=g).float() / 199
    labels = torch.randint(0, 3, (n,), generator=g)
    for margin in (0, 2, 16):
        d = rank_margin_loss(cos, scores, margin=margin, method="dense")
        s = rank_margin_loss(cos, scores, margin=margin, method="sorted")
        assert s.item() == pytest.approx(d.item(), rel=1e-6)
    d = gated_angle_loss(cos, labels, scores, method="dense")
    s = gated_angle_loss(cos, labels, scores, method="sorted")
    assert s.item() == pytest.approx(d.item(), rel=1e-6)


@pytest.mark.parametrize("method", ["dense", "sorted"])
def test_gradcheck(method):
    cos, scores, labels = random_batch(5, n=10)
    cos = (cos * 0.9).requires_grad_()
    assert torch.autograd.gradcheck(lambda c: rank_margin_loss(c, scores, margin=1, tau=3.0, method=method), (cos,))
    assert torch.autograd.gradcheck(lambda c: gated_angle_loss(c, labels, scores, tau=3.0, method=method), (cos,))


@pytest.mark.parametrize("method", ["dense", "sorted"])
def test_gradients_finite_when_cosine_is_exactly_plus_minus_one(method):
    cos = torch.tensor([1.0, -1.0, 1.0, 0.3, -1.0, 0.99], requires_grad=True)
    scores = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.4, 0.8])
    labels = torch.tensor([2, 0, 1, 2, 0, 1])
    loss = gated_angle_loss(cos, labels, scores, method=method) + rank_margin_loss(cos, scores, margin=0, method=method)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(cos.grad).all()
    assert cos.grad[0] != 0  # the angle keeps a gradient in the saturation zone


def test_sorted_form_handles_a_global_batch_of_65536():
    g = torch.Generator().manual_seed(0)
    n = 65536
    cos = (torch.rand(n, generator=g) * 2 - 1).requires_grad_()
    scores = torch.rand(n, generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    loss = rank_margin_loss(cos, scores) + gated_angle_loss(cos, labels, scores)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(cos.grad).all()
