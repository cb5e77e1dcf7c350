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
            "relation_table": torch.randn(2, 8, generator=g)}


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
