"""Which batch fields the workers gather is decided once from the config, the same on every worker: a worker whose
rows lack S must issue the same collectives as one whose rows have it (else the all-gathers misalign or hang)."""

import numpy as np
import pytest

from training.kinds import TRAINING_KINDS
from training.run import check_objective_fits

PAIRS = TRAINING_KINDS["pairs"]  # its build(): a micro-batch as one chunk


@pytest.mark.parametrize("weights, kind, fields", [
    ({"rank_margin": 1.0, "gated_angle": 1.0}, "pairs", {"scores", "labels"}),
    ({"cosent": 1.0}, "sts", {"scores"}),
    ({"infonce": 1.0}, "triplets", set()),
    ({"angle_ibn": 1.0}, "pairs", {"labels"}),  # NLI labels pick the positives
    ({"angle_ibn": 1.0}, "sts", {"scores"}),  # S >= threshold does without labels
])
def test_the_fields_an_objective_reads_come_from_the_config(weights, kind, fields):
    read = check_objective_fits(weights, TRAINING_KINDS[kind].provides)
    assert read & {"scores", "labels"} == fields


def test_workers_with_and_without_s_issue_the_same_gathers(monkeypatch):
    import torch

    import training.kinds.base as base
    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source
    from training.kinds import BatchContext

    calls = []  # every gather of scores, labels and text ids goes through BatchContext (training/kinds/base.py)
    monkeypatch.setattr(base, "gather_no_grad", lambda t: calls.append(tuple(t.shape)) or t)
    model = build_encoder(resolve_model_source("tiny:bert"), dropout=0.0)
    texts = np.array(["a man sits", "a dog runs", "two kids play"], dtype=object)
    annotated = {"text1": texts, "text2": texts[::-1], "label": np.array([0, 1, 2]), "similarity": np.array([.9, .5, .1])}
    missing = {**annotated, "similarity": np.array([.9, None, .1], dtype=object)}
    sequences = []
    for rows in (annotated, missing):
        calls.clear()
        batch = PAIRS.build(BatchContext(model, model, torch.device("cpu"), fields=("scores", "labels")), rows)
        sequences.append(list(calls))
    assert sequences[0] == sequences[1] and len(sequences[0]) == 4  # scores, labels, ids1, ids2 on both
    assert np.isnan(batch.scores[1].item())  # the gap is kept, and the objective then refuses it by name


@pytest.mark.parametrize("weights, refused", [({"rank_margin": 1.0, "gated_angle": 1.0}, "rank_margin"),
                                              ({"cosent": 1.0}, "cosent"), ({"infonce": 1.0}, "infonce"),
                                              ({"hince": 1.0}, "hince"), ({"relational": 1.0}, "relational")])
def test_a_one_row_batch_is_refused_for_objectives_that_compare_rows(weights, refused, tmp_path):
    """One RAOE pair per step once trained to status ok with loss 0 and gradient norm 0 at every step."""
    from tests.training.conftest import tiny_config
    from training.run import check_batch_fits, run_training

    with pytest.raises(ValueError, match=f"trainer.global_batch_size=1 is too small for objective '{refused}'"):
        check_batch_fits(weights, 1)
    check_batch_fits(weights, 2)
    check_batch_fits({"listmle": 1.0}, 1)  # ranks within each list
    with pytest.raises(ValueError, match=f"global_batch_size=4 / trainer.grad_accum=4 = 1 rows a micro-batch is too "
                                         f"small for objective '{refused}'"):
        check_batch_fits(weights, 4, grad_accum=4)  # each micro-batch is its own objective
    check_batch_fits(weights, 4, grad_accum=2)
    if refused == "rank_margin":  # the job refuses it before any Ray resource (no Ray is running here)
        with pytest.raises(ValueError, match="trainer.global_batch_size=1 is too small for objective 'rank_margin'"):
            run_training(tiny_config(tmp_path, "one-row", "trainer.global_batch_size=1"))


def test_mined_triplets_train_infonce_with_their_false_negatives_masked():
    """data.format triplets_jsonl picks the mined-triplets kind; its batch carries the negatives' text ids, so a pair
    repeated with each of its negatives does not count its own positive twice, nor a negative equal to a positive."""
    import torch

    from jobconfig.schema import TrainJobConfig
    from objectives.composite import CompositeObjective
    from objectives.contrastive import infonce_loss
    from training.kinds import BatchContext
    from training.run import choose_kind

    cfg = TrainJobConfig(data={"train": "mined", "format": "triplets_jsonl"}, objective={"weights": {"infonce": 1.0}})
    kind, read = choose_kind(cfg)
    assert kind.name == "mined_triplets" and "ids_neg" in read
    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source

    model = build_encoder(resolve_model_source("tiny:bert"), dropout=0.0)
    rows = {"text1": np.array(["a man sits", "a man sits", "a dog runs"], dtype=object),
            "text2": np.array(["a person sits", "a person sits", "an animal runs"], dtype=object),
            "text_neg": np.array(["a man stands", "a dog sits", "a person sits"], dtype=object),
            "label": np.array([0, 0, 0]), "similarity": np.array([np.nan] * 3)}
    batch = kind.build(BatchContext(model, model, torch.device("cpu"), fields=()), rows)
    assert batch.emb_neg.shape[0] == 3 and batch.ids_neg[2] == batch.ids2[0]
    loss = CompositeObjective({"infonce": 1.0})(batch)[0]
    unmasked = infonce_loss(batch.emb1, batch.emb2, batch.emb_neg)
    masked = infonce_loss(batch.emb1, batch.emb2, batch.emb_neg, anchor_ids=batch.ids1, positive_ids=batch.ids2,
                          negative_ids=batch.ids_neg)
    assert loss.item() == pytest.approx(masked.item(), rel=1e-5) and abs(loss.item() - unmasked.item()) > 1e-3


def test_negatives_the_objective_does_not_read_are_not_encoded(ray_local):
    """Triplets trained with an objective that reads no negatives drop them before training (no forward, no gather);
    one that reads them keeps them."""
    import ray
    import torch

    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source
    from training.kinds import TRAINING_KINDS, BatchContext
    from training.run import check_objective_fits, without_unread_negatives

    ds = ray.data.from_items([{"text1": "a", "text2": "b", "text_neg": "c", "label": 0}])
    provided = TRAINING_KINDS["triplets"].provides
    kept = without_unread_negatives(ds, check_objective_fits({"infonce": 1.0}, provided))
    dropped = without_unread_negatives(ds, check_objective_fits({"angle_ibn": 1.0}, provided))
    assert "text_neg" in kept.columns() and "text_neg" not in dropped.columns()
    model = build_encoder(resolve_model_source("tiny:bert"))
    ctx = BatchContext(model, model, torch.device("cpu"), sides=TRAINING_KINDS["triplets"].sides)
    assert TRAINING_KINDS["triplets"].encode_calls(ctx, dropped.take_batch(1)) == [(["a", "b"], None, "query")]
