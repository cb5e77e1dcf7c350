"""Unsupervised SimCSE and SimCSE+SAN: dropout views as positives, aligned negatives at their own dropout p2, HiNCE
reducing to InfoNCE with hard negatives, and the job on 1 and 2 workers (one of them killed and resumed)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from encoders.backbone import build_encoder, forward_pass
from encoders.sources import resolve_model_source
from objectives.composite import CompositeObjective
from tests.training.conftest import ONE_STEP_APART_REL, ROOT, SAME_START_REL, metric_by_step
from training.faults import KillWorkerAfterStep
from training.kinds import TRAINING_KINDS, BatchContext
from training.kinds.base import dropout_rate

SENTENCES = TRAINING_KINDS["sentences_san"]  # its build(): a micro-batch as one chunk

SAN = ROOT / "configs" / "tiny" / "data" / "sentences_san.jsonl"
ROWS = [json.loads(line) for line in SAN.read_text().splitlines()[:6]]
BATCH = {"text": np.array([r["text"] for r in ROWS], dtype=object),
         "negative": np.array([r["negative"] for r in ROWS], dtype=object)}


def _model(dropout):
    model = build_encoder(resolve_model_source("tiny:bert"), dropout=dropout)
    model.train()
    return model


def test_dropout_rate_sets_every_dropout_inside_the_block_only():
    model = _model(0.1)
    rates = lambda: {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}  # noqa: E731
    assert rates() == {0.1}
    with dropout_rate(model, 0.3):
        assert rates() == {0.3}
    assert rates() == {0.1}


def test_two_dropout_views_are_the_positive_and_negatives_get_p2():
    model = _model(0.1)
    torch.manual_seed(0)
    batch = SENTENCES.build(BatchContext(model, model, torch.device("cpu"), negative_dropout=0.0), BATCH)
    assert not torch.allclose(batch.emb1, batch.emb2, atol=1e-4)  # the same sentences, different dropout masks
    model.eval()
    with torch.no_grad():
        assert torch.allclose(batch.emb_neg, forward_pass(model, model, list(BATCH["negative"])), atol=1e-5)  # p2 = 0
    assert torch.equal(batch.ids1, batch.ids2)


def test_hince_with_equal_temperatures_and_dropouts_is_infonce_with_hard_negatives():
    model = _model(0.1)
    torch.manual_seed(1)
    batch = SENTENCES.build(BatchContext(model, model, torch.device("cpu"), negative_dropout=0.1), BATCH)
    hince, _ = CompositeObjective({"hince": 1.0}, {"hince": {"tau1": 0.05, "tau2": 0.05}})(batch)
    infonce, _ = CompositeObjective({"infonce": 1.0}, {"infonce": {"tau": 0.05}})(batch)
    assert hince.item() == pytest.approx(infonce.item(), rel=1e-6)
    tau2, _ = CompositeObjective({"hince": 1.0}, {"hince": {"tau1": 0.05, "tau2": 0.08}})(batch)
    assert tau2.item() != pytest.approx(infonce.item(), rel=1e-3)


def _hince_loss_and_grad_norm(checkpointing: bool) -> tuple[float, float]:
    model = build_encoder(resolve_model_source("tiny:bert"), dropout=0.1, gradient_checkpointing=checkpointing)
    model.train()
    torch.manual_seed(3)
    # tau2 = tau1: at the paper's 0.08 a random tiny encoder gives the negatives ~1e-3 of the softmax, too little
    # gradient for the claim to show
    objective = CompositeObjective({"hince": 1.0}, {"hince": {"tau1": 0.05, "tau2": 0.05}})
    loss, _ = objective(SENTENCES.build(BatchContext(model, model, torch.device("cpu"), negative_dropout=0.4), BATCH))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return loss.item(), torch.nn.utils.get_total_norm(grads).item()


def test_gradient_checkpointing_recomputes_the_negatives_at_their_own_dropout():
    """The negatives' p2 is set only around their forward; the checkpointed recompute in backward must use it too
    (it once ran at model.dropout)."""
    plain, checkpointed = _hince_loss_and_grad_norm(False), _hince_loss_and_grad_norm(True)
    assert checkpointed[0] == pytest.approx(plain[0], rel=1e-6)
    assert checkpointed[1] == pytest.approx(plain[1], rel=1e-5)


def test_anchors_without_an_aligned_negative_stay_in_the_batch_masked():
    model = _model(0.0)
    rows = {"text": BATCH["text"], "negative": np.array([n if i % 3 else None for i, n in enumerate(BATCH["negative"])],
                                                        dtype=object)}
    batch = SENTENCES.build(BatchContext(model, model, torch.device("cpu"), negative_dropout=0.0), rows)
    assert batch.neg_mask.tolist() == [False, True, True, False, True, True]
    assert batch.emb_neg.shape == batch.emb1.shape  # one row per anchor: every worker encodes the same count
    masked, _ = CompositeObjective({"hince": 1.0})(batch)
    assert torch.isfinite(masked) and masked.item() != pytest.approx(
        CompositeObjective({"hince": 1.0})(dataclasses.replace(batch, neg_mask=None))[0].item(), rel=1e-4)


def _config(root, name, *overrides):
    from jobconfig import load_config
    from jobconfig.schema import UnsupervisedJobConfig

    base = [f"tracking.run_name={name}", f"trainer.storage_path={root / 'runs'}", f"output_dir={root / 'models'}",
            f"eval.data_dir={root / 'no-dev-data'}", f"data.train={SAN}", "tracking.experiment=raoe-test",
            "model.dropout=0.0", "model.negative_dropout=0.0", "trainer.max_steps=4", "trainer.eval_every=2",
            "trainer.warmup_ratio=0.0", "data.cache=false"]
    return load_config(UnsupervisedJobConfig, ROOT / "configs" / "tiny" / "unsupervised.yaml", base + list(overrides))


@pytest.fixture(scope="module")
def unsupervised_runs(train_env, tmp_path_factory):
    """The SAN corpus with every 4th anchor left without a negative (as generate_san keeps anchors its guard
    refused), aligned negatives at their own dropout p2 = 0.2: on 1 worker (in the test's process), and on 2 Ray Train
    workers with one killed mid-run. About 65 s here: the two-worker run starts its group of workers twice."""
    from training.run import run_training

    rows = [json.loads(line) for line in SAN.read_text().splitlines()]
    corpus = tmp_path_factory.mktemp("unsupervised") / "guarded.jsonl"
    corpus.write_text("".join(json.dumps({"text": r["text"], "negative": r["negative"] if i % 4 else None}) + "\n"
                              for i, r in enumerate(rows)))
    guarded = (f"data.train={corpus}", "model.negative_dropout=0.2")
    one = run_training(_config(train_env, "unsup-1", *guarded, "trainer.num_workers=0"))  # in this process
    two = run_training(_config(train_env, "unsup-2", *guarded, "trainer.num_workers=2", "trainer.max_failures=1"),
                       after_step=(KillWorkerAfterStep(3),))  # the group restarts from the step-2 checkpoint
    return one, two, len(rows)


def test_unsupervised_job_is_the_same_on_two_workers_and_survives_a_killed_worker(unsupervised_runs):
    from mlflow import MlflowClient

    one, two, rows = unsupervised_runs
    assert one["registered_model"] == two["registered_model"] == "raoe-unsup" and one["stage"] == "unsupervised"
    assert rows == 128 and two["metrics"]["steps"] == 4 and two["rows_written"] == 128
    steps = [m.step for m in MlflowClient().get_metric_history(two["run_id"], "train_loss")]
    assert sorted(steps) == [1, 2, 3, 3, 4]  # step 3 ran twice: the worker really died and the run resumed
    for key in ("train_loss", "grad_norm"):
        expected, got = metric_by_step(one["run_id"], key), metric_by_step(two["run_id"], key)
        assert got[1] == pytest.approx(expected[1], rel=SAME_START_REL), key
        for step in (2, 3, 4):
            assert got[step] == pytest.approx(expected[step], rel=ONE_STEP_APART_REL), f"{key} at step {step}"


def test_hince_needs_aligned_negatives_and_says_so(train_env, tmp_path):
    from training.run import run_training

    plain = tmp_path / "plain.txt"
    plain.write_text("".join(f"{r['text']}\n" for r in ROWS * 6))
    with pytest.raises(ValueError, match="have no 'negative'"):
        run_training(_config(train_env, "unsup-no-neg", f"data.train={plain}", "trainer.global_batch_size=8"))


def test_a_san_corpus_with_guarded_anchors_trains_on_every_anchor(unsupervised_runs):
    """generate_san keeps anchors its guard left without a negative; HiNCE trains on all of them (the runs above:
    every 4th of the 128 anchors has none)."""
    one, _, rows = unsupervised_runs
    assert one["rows_written"] == rows == 128 and one["metrics"]["steps"] == 4
    assert one["metrics"]["train_loss"] > 0
