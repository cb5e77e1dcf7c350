"""The composite built from config: weighted sum, presets, metadata, clear errors."""

import pytest
import torch

from objectives import PRESETS, SPECS, CompositeObjective, EmbeddingBatch, gated_angle_loss, rank_margin_loss


def batch():
    g = torch.Generator().manual_seed(0)
    e1, e2 = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.randn(10, 4, generator=g, dtype=torch.float64)
    return EmbeddingBatch(emb1=e1, emb2=e2, scores=torch.rand(10, generator=g, dtype=torch.float64),
                          labels=torch.randint(0, 3, (10,), generator=g))


def test_raoe_composite_is_rank_margin_plus_gated_angle():
    b = batch()
    total, parts = CompositeObjective({"rank_margin": 1.0, "gated_angle": 2.0}, {"rank_margin": {"margin": 1}})(b)
    cos = torch.nn.functional.cosine_similarity(b.emb1, b.emb2)
    want_rank = rank_margin_loss(cos, b.scores, margin=1)
    want_angle = gated_angle_loss(cos, b.labels, b.scores)
    assert parts["rank_margin"].item() == pytest.approx(want_rank.item())
    assert total.item() == pytest.approx((want_rank + 2 * want_angle).item())


def test_every_objective_has_defaults_and_a_citation():
    for spec in SPECS.values():
        assert spec.references and spec.summary and isinstance(spec.defaults, dict)
        for ref in spec.references:  # cited by title with an arXiv id or a link, never a file of ours
            assert ref.title in ref.bibtex() and ".txt" not in ref.short()
    assert SPECS["infonce"].references[0].link == "https://arxiv.org/abs/2104.08821"
    assert "eprint = {2212.08802}" in SPECS["relational"].references[0].bibtex()
    assert SPECS["rank_margin"].defaults == {"margin": 2.0, "tau": 20.0}
    assert SPECS["hince"].defaults == {"tau1": 0.05, "tau2": 0.08}
    for weights in PRESETS.values():
        assert set(weights) <= set(SPECS)


def test_errors_name_the_problem():
    with pytest.raises(KeyError, match="unknown objective 'rank_marginn'"):
        CompositeObjective({"rank_marginn": 1.0})
    with pytest.raises(KeyError, match="has no parameter 'margn'"):
        CompositeObjective({"rank_margin": 1.0}, {"rank_margin": {"margn": 3}})
    with pytest.raises(ValueError, match="needs batch fields \\['emb_neg'\\]"):
        CompositeObjective({"hince": 1.0})(batch())
    with pytest.raises(ValueError, match="non-zero weight"):
        CompositeObjective({"rank_margin": 0.0})


def test_describe_reports_what_is_trained():
    d = CompositeObjective(PRESETS["raoe"]).describe()
    assert d["rank_margin"]["params"] == {"margin": 2.0, "tau": 20.0} and d["gated_angle"]["weight"] == 1.0


@pytest.mark.parametrize("field, value, match", [("scores", float("nan"), "NaN or infinite"),
                                                 ("scores", float("inf"), "NaN or infinite"),
                                                 ("labels", -1, "entailment/neutral/contradiction")])
def test_non_finite_scores_and_unknown_labels_are_refused_by_name(field, value, match):
    g = torch.Generator().manual_seed(0)
    batch = EmbeddingBatch(emb1=torch.randn(6, 8, generator=g), emb2=torch.randn(6, 8, generator=g),
                           scores=torch.tensor([0.9, 0.5, 0.1, 0.7, 0.3, 0.2]), labels=torch.tensor([0, 1, 2, 0, 2, 1]))
    CompositeObjective(PRESETS["raoe"])(batch)  # clean: fine
    getattr(batch, field)[2] = value
    with pytest.raises(ValueError, match=match):
        CompositeObjective(PRESETS["raoe"])(batch)


def _dummy_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"emb1": torch.randn(4, 8, generator=g), "emb2": torch.randn(4, 8, generator=g),
            "labels": torch.tensor([0, 1, 2, 0]), "scores": torch.tensor([0.9, 0.5, 0.1, 0.7]),
            "ids1": torch.arange(4), "ids2": torch.arange(4, 8), "emb_neg": torch.randn(4, 8, generator=g),
            "neg_mask": torch.tensor([True, True, False, True]), "list_emb": torch.randn(2, 3, 8, generator=g),
            "list_mask": torch.ones(2, 3, dtype=torch.bool), "list_target": torch.rand(2, 3, 3, generator=g),
            "ids_neg": torch.arange(8, 12), "relation": torch.tensor([0, 1, 0, 1]),
            "relation_table": torch.randn(2, 8, generator=g), "teacher_scores": torch.randn(4, 2, generator=g)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_declared_fields_are_what_each_objective_reads(name):
    """Each objective runs on a batch holding only what one kind of data provides (and on a full one) while the
    fields it touches are recorded: the declaration must name exactly those, and refuse where the objective fails."""
    from objectives.composite import EmbeddingBatch, fields_read
    from training.kinds import TRAINING_KINDS

    read: set[str] = set()

    class RecordingBatch(EmbeddingBatch):
        def __getattribute__(self, attr):
            if attr in EmbeddingBatch.__dataclass_fields__:
                read.add(attr)
            return super().__getattribute__(attr)

    full = _dummy_batch(torch.Generator().manual_seed(0))
    for provided in [tuple(full), *(kind.provides for kind in TRAINING_KINDS.values())]:
        read.clear()
        try:
            CompositeObjective({name: 1.0}).parts(RecordingBatch(**{k: full[k] for k in provided}))
            ran = True
        except ValueError:
            ran = False
        try:
            declared = fields_read({name: 1.0}, provided)
        except ValueError:
            assert not ran, f"{name} runs on {provided} but its declaration refuses it"
            continue
        assert ran, f"{name} fails on {provided} but its declaration accepts it"
        assert declared == read & set(provided), provided


def test_matryoshka_sums_the_composite_at_each_truncated_renormalised_dimension():
    """objective.matryoshka: each (dim, weight) adds the whole composite on the batch cut to its first dim
    dimensions, renormalised; parts are named per dimension; the gradient reaches only the dimensions trained."""
    from objectives.composite import truncated

    g = torch.Generator().manual_seed(1)
    e1, e2, neg = (torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    b = EmbeddingBatch(emb1=e1, emb2=e2, emb_neg=neg, scores=torch.rand(10, generator=g, dtype=torch.float64),
                       labels=torch.randint(0, 3, (10,), generator=g))
    weights = {"infonce": 1.0, "rank_margin": 0.5}
    plain = CompositeObjective(weights)
    total, parts = CompositeObjective(weights, matryoshka=((8, 1.0), (4, 0.5), (2, 0.25)))(b)
    want = sum(w * plain(truncated(b, d))[0] for d, w in ((8, 1.0), (4, 0.5), (2, 0.25)))
    assert total.item() == pytest.approx(want.item(), rel=1e-12)
    assert set(parts) == {f"{n}_dim{d}" for n in weights for d in (8, 4, 2)}
    assert parts["infonce_dim4"].item() == pytest.approx(plain(truncated(b, 4))[1]["infonce"].item(), rel=1e-12)
    cut = truncated(b, 4)
    torch.testing.assert_close(cut.emb1.norm(dim=-1), torch.ones(10, dtype=torch.float64))
    assert abs(total.item() - plain(b)[0].item()) > 1e-3  # the truncated terms change the loss
    grad = torch.autograd.grad(CompositeObjective(weights, matryoshka=((4, 1.0), (2, 1.0)))(b)[0], e1)[0]
    assert grad[:, 4:].abs().sum().item() == 0 and grad[:, :4].abs().sum().item() > 0
    with pytest.raises(ValueError, match="matryoshka.dims: 16 exceeds the model's 8 embedding dimensions"):
        CompositeObjective(weights, matryoshka=((16, 1.0),))(b)


def test_matryoshka_config_is_checked():
    from pydantic import ValidationError

    from jobconfig.schema import MatryoshkaConfig

    assert MatryoshkaConfig(dims=[64, 384, 128], weights=[0.5, 1, 2]).pairs() == ((384, 1.0), (128, 2.0), (64, 0.5))
    with pytest.raises(ValidationError, match="distinct sizes"):
        MatryoshkaConfig(dims=[64, 64])
    with pytest.raises(ValidationError, match="one number >= 0 per dim"):
        MatryoshkaConfig(dims=[64, 32], weights=[1.0])
