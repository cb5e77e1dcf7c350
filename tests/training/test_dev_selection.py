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
    dev = read_dev_set(str(folder))
    again = dev_ndcg_at_10(lambda texts, side: inference_embeddings(exported, texts, 64, side), dev)
    assert again == pytest.approx(scores[best_step], abs=1e-3)


def test_a_trained_models_query_and_document_prompts_reach_sentence_transformers(simcse_retrieval_dev_run):
    """The run's model.prompts and query length are in the export: sentence-transformers' encode_query and
    encode_document give raoe's query-side and document-side embeddings, which differ from each other."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.retrieval import read_dev_set

    out, folder = simcse_retrieval_dev_run
    texts = read_dev_set(str(folder)).task.query_texts[:8]
    st, exported = SentenceTransformer(out["model_path"], device="cpu"), load_encoder(out["model_path"])
    assert st.prompts["query"] == "query: " and st.prompts["document"] == "passage: " and st[0].query_length == 12
    query, document = st.encode_query(texts), st.encode_document(texts)
    np.testing.assert_allclose(query, inference_embeddings(exported, texts, side="query"), atol=1e-5)
    np.testing.assert_allclose(document, inference_embeddings(exported, texts, side="document"), atol=1e-5)
    assert not np.allclose(query, document, atol=1e-3)
    assert "query `query: ` (at most 12 tokens)" in (Path(out["model_path"]) / "README.md").read_text()
