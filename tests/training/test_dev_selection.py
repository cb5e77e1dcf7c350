"""Checkpoint selection on a dev set the driver reads once and hands to every worker (a worker's node may not hold
it). STS-B dev scored by every ZeRO-3 rank while the files are gone: tests/training/test_distributed.py; a run without
a dev set exports its latest checkpoint: tests/training/test_exact_resume.py (runs those modules train anyway)."""

import json
from pathlib import Path

import pytest


def test_a_retrieval_dev_task_selects_checkpoints_by_its_ndcg(simcse_retrieval_dev_run):
    """eval.dev_retrieval: every evaluation logs the task's nDCG@10 (x100) under dev_ndcg_at_10, the checkpoint
    with the best one is exported, and that model scores the same on the task when scored again here. The run (shared
    with test_simcse_training, conftest.py) is SimCSE on the tiny NLI triplets; its task, the premises retrieving their
    entailments among every hypothesis, moves with training."""
    from mlflow import MlflowClient

    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.retrieval import dev_ndcg_at_10, read_dev_set

    out, folder = simcse_retrieval_dev_run
    scores = {m.step: m.value for m in MlflowClient().get_metric_history(out["run_id"], "dev_ndcg_at_10")}
    assert sorted(scores) == [1, 2, 3] and len(set(scores.values())) > 1  # training moves it
    best_step = max(sorted(scores), key=lambda s: (scores[s], s))
    assert out["metrics"]["best_dev_ndcg_at_10"] == pytest.approx(scores[best_step])
    assert out["metrics"]["best_step"] == best_step and "best_stsb_dev_spearman" not in out["metrics"]
    meta = json.loads((Path(out["model_path"]) / "raoe_encoder.json").read_text())
    assert meta["step"] == best_step
    exported = load_encoder(out["model_path"])
    again = dev_ndcg_at_10(lambda texts: inference_embeddings(exported, texts, 64), read_dev_set(str(folder)))
    assert again == pytest.approx(scores[best_step], abs=1e-3)
