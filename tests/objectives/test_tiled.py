"""The tiled, sharded in-batch losses equal the dense ones: for InfoNCE, HiNCE (with a masked placeholder), RSE's
relational loss and AnglE's in-batch negatives (both with duplicate texts left out), the shares of 3 workers' anchor
rows, computed in tiles of a few candidates, sum to the dense loss, and so do their gradients (float64, 1e-12)."""

import pytest
import torch

from objectives import tiled
from objectives.angle import angle_ibn_loss, angle_ibn_share
from objectives.composite import anchor_rows
from objectives.contrastive import hince_loss, hince_share
from objectives.relational import relational_loss, relational_share

B, D = 11, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    e1, e2, neg = (torch.randn(B, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(3, D, generator=g, dtype=torch.float64, requires_grad=True)
    ids1 = torch.tensor([1, 2, 3, 1, 5, 6, 7, 8, 2, 10, 11])  # repeated anchors
    ids2 = torch.tensor([21, 22, 23, 24, 21, 26, 1, 28, 29, 30, 31])  # a repeated positive; a positive equal to text 1
    ids_neg = torch.tensor([40, 22, 42, 43, 44, 45, 46, 47, 48, 23, 50])  # negatives equal to a tail
    group = torch.randn(3 * B, D, generator=g, dtype=torch.float64, requires_grad=True)  # 3 negatives per query
    ids_group = torch.cat([ids_neg, torch.arange(60, 60 + 2 * B)])
    ids_group[15] = 21  # a group's negative equal to another row's positive text
    return {"e1": e1, "e2": e2, "neg": neg, "group": group, "ids_group": ids_group, "table": table, "ids1": ids1,
            "ids2": ids2, "ids_neg": ids_neg,
            "relation": torch.arange(B) % 3, "mask": torch.arange(B) % 4 != 1,
            "positive": torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)}


LOSSES = {
    "infonce": (lambda x: hince_loss(x["e1"], x["e2"], x["neg"], tau1=0.05, tau2=0.05),
                lambda x, rows: hince_share(x["e1"], x["e2"], x["neg"], rows, tau1=0.05, tau2=0.05)),
    "hince masked": (lambda x: hince_loss(x["e1"], x["e2"], x["neg"], tau1=0.05, tau2=0.08, negative_mask=x["mask"]),
                     lambda x, rows: hince_share(x["e1"], x["e2"], x["neg"], rows, tau1=0.05, tau2=0.08,
                                                 negative_mask=x["mask"])),
    "infonce false negatives": (
        lambda x: hince_loss(x["e1"], x["e2"], x["neg"], tau1=0.05, tau2=0.05, anchor_ids=x["ids1"],
                             positive_ids=x["ids2"], negative_ids=x["ids_neg"]),
        lambda x, rows: hince_share(x["e1"], x["e2"], x["neg"], rows, tau1=0.05, tau2=0.05, anchor_ids=x["ids1"],
                                    positive_ids=x["ids2"], negative_ids=x["ids_neg"])),
    "infonce query groups": (  # B' = 3B negatives, every query against all of them
        lambda x: hince_loss(x["e1"], x["e2"], x["group"], tau1=0.05, tau2=0.05, anchor_ids=x["ids1"],
                             positive_ids=x["ids2"], negative_ids=x["ids_group"]),
        lambda x, rows: hince_share(x["e1"], x["e2"], x["group"], rows, tau1=0.05, tau2=0.05, anchor_ids=x["ids1"],
                                    positive_ids=x["ids2"], negative_ids=x["ids_group"])),
    "simcse in-batch only": (lambda x: hince_loss(x["e1"], x["e2"], None, tau1=0.05, tau2=0.05),
                             lambda x, rows: hince_share(x["e1"], x["e2"], None, rows, tau1=0.05, tau2=0.05)),
    "relational": (lambda x: relational_loss(x["e1"], x["e2"], x["relation"], x["table"], x["neg"], x["ids1"],
                                             x["ids2"], x["ids_neg"], tau=0.05),
                   lambda x, rows: relational_share(x["e1"], x["e2"], x["relation"], x["table"], x["neg"], x["ids1"],
                                                    x["ids2"], x["ids_neg"], rows, tau=0.05)),
    "angle_ibn": (lambda x: angle_ibn_loss(x["e1"], x["e2"], x["positive"], tau=20.0, ids1=x["ids1"], ids2=x["ids2"]),
                  lambda x, rows: angle_ibn_share(x["e1"], x["e2"], x["positive"], rows, tau=20.0, ids1=x["ids1"],
                                                  ids2=x["ids2"])),
}


def _value_and_grads(x, loss):
    leaves = [x[k] for k in ("e1", "e2", "neg", "group", "table")]
    for leaf in leaves:
        leaf.grad = None
    value = loss()
    value.backward()
    return value.detach(), [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in leaves]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_shares_of_three_workers_in_tiles_sum_to_the_dense_loss(monkeypatch, name):
    dense, share = LOSSES[name]
    x = _inputs()
    want, want_grads = _value_and_grads(x, lambda: dense(x))
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 8)  # 2 candidates a tile for 4 anchors: many tiles per share
    got, got_grads = _value_and_grads(x, lambda: sum(share(x, anchor_rows(B, r, 3)) for r in range(3)))
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert any(bool(w.abs().sum() > 0) for w in want_grads)


def test_an_excluded_candidate_never_enters_the_softmax():
    """Changing an excluded candidate (a duplicate positive text) changes nothing; changing an allowed one does."""
    x = _inputs()
    base = angle_ibn_share(x["e1"], x["e2"], x["positive"], slice(0, 1), ids1=x["ids1"], ids2=x["ids2"])
    moved = x["e2"].detach().clone()
    moved[4] = x["e1"][0].detach()  # text 21, anchor 0's own positive text: excluded from anchor 0's denominator
    same = angle_ibn_share(x["e1"], moved, x["positive"], slice(0, 1), ids1=x["ids1"], ids2=x["ids2"])
    moved[5] = x["e1"][0].detach()  # an ordinary candidate, now the anchor itself
    other = angle_ibn_share(x["e1"], moved, x["positive"], slice(0, 1), ids1=x["ids1"], ids2=x["ids2"])
    assert same.item() == pytest.approx(base.item(), rel=1e-12) and abs(other.item() - base.item()) > 0.1


def test_infonce_leaves_false_negatives_out():
    """With text ids, InfoNCE's softmax of anchor 0 loses exactly its false negatives: the positive of row 3 (the
    same query), of row 4 (the same positive text) and the hard negative of row 1 (text 22 is not anchor 0's
    positive, so it stays) - checked against the cross-entropy over the remaining candidates, written out."""
    from objectives.contrastive import infonce_loss

    x = _inputs()
    e1, e2, neg = (x[k].detach() for k in ("e1", "e2", "neg"))
    ids1, ids2, ids_neg = x["ids1"], x["ids2"], x["ids_neg"].clone()
    ids_neg[7] = 21  # a mined negative whose text is anchor 0's positive: a false negative for anchor 0 only
    got = infonce_loss(e1, e2, neg, tau=0.05, anchor_ids=ids1, positive_ids=ids2, negative_ids=ids_neg)
    cos = torch.nn.functional.cosine_similarity
    losses = []
    for i in range(B):
        keep_pos = [j for j in range(B) if j == i or (ids1[j] != ids1[i] and ids2[j] != ids2[i])]
        keep_neg = [j for j in range(B) if ids_neg[j] != ids2[i]]
        logits = torch.stack([cos(e1[i], e2[j], dim=0) for j in keep_pos] + [cos(e1[i], neg[j], dim=0)
                                                                              for j in keep_neg]) / 0.05
        losses.append(torch.logsumexp(logits, 0) - logits[keep_pos.index(i)])
    assert got.item() == pytest.approx(torch.stack(losses).mean().item(), rel=1e-12)
    plain = infonce_loss(e1, e2, neg, tau=0.05)
    assert abs(plain.item() - got.item()) > 1e-5  # the masks change the loss
