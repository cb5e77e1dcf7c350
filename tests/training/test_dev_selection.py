"""Checkpoint selection by STS-B dev: the driver reads the dev pairs once and hands them to every worker (a worker's
node may not hold eval.data_dir), and a run without a dev set scores no checkpoint: it keeps and exports its latest."""

import json
from pathlib import Path

import pytest

from tests.training.conftest import TINY_NLI, tiny_config


def _stsb_dev(root, pairs: int = 24):
    """A SentEval-layout STS-B dev of the tiny NLI pairs, gold from their similarity S."""
    rows = [json.loads(line) for line in TINY_NLI.read_text().splitlines()[:pairs]]
    folder = root / "STS" / "STSBenchmark"
    folder.mkdir(parents=True)
    (folder / "sts-dev.csv").write_text("".join(
        f"main-captions\tMSRvid\t2012test\t{i:04d}\t{5 * r['similarity']:.3f}\t{r['text1']}\t{r['text2']}\n"
        for i, r in enumerate(rows)))
    return root


def test_workers_score_dev_pairs_the_driver_read_when_their_node_lacks_the_files(train_env, tmp_path, monkeypatch):
    """The dev folder disappears as soon as the driver has read it, as on a cluster where only the head holds it:
    two ZeRO-3 workers still score every checkpoint (all ranks run the encoder, none hangs)."""
    from mlflow import MlflowClient

    import training.run

    dev = _stsb_dev(tmp_path / "senteval")
    read = training.run.stsb_dev_pairs

    def read_then_hide(data_dir, max_pairs=None):
        pairs = read(data_dir, max_pairs)
        dev.rename(tmp_path / "elsewhere")
        return pairs

    monkeypatch.setattr(training.run, "stsb_dev_pairs", read_then_hide)
    out = training.run.run_training(tiny_config(
        train_env, "dev-on-driver", f"eval.data_dir={dev}", "trainer.num_workers=2", "trainer.strategy=deepspeed",
        "trainer.zero_stage=3", "trainer.max_steps=2", "trainer.eval_every=1", "trainer.global_batch_size=8"))
    scores = MlflowClient().get_metric_history(out["run_id"], "stsb_dev_spearman")
    assert sorted(m.step for m in scores) == [1, 2]
    assert out["metrics"]["best_stsb_dev_spearman"] == pytest.approx(max(m.value for m in scores))


def test_a_run_without_dev_scores_no_checkpoint_and_exports_its_latest(train_env):
    from training.run import run_training

    out = run_training(tiny_config(train_env, "no-dev", "trainer.max_steps=3", "trainer.eval_every=1",
                                   "trainer.keep_checkpoints=2", "trainer.global_batch_size=16"))
    assert out["metrics"]["best_stsb_dev_spearman"] is None
    assert out["metrics"]["best_step"] == 3 and out["metrics"]["steps"] == 3
    meta = json.loads((Path(out["model_path"]) / "raoe_encoder.json").read_text())
    assert meta["step"] == 3 and meta["stsb_dev_spearman"] is None


def test_a_retrieval_dev_task_selects_checkpoints_by_its_ndcg(train_env, tmp_path):
    """eval.dev_retrieval: every evaluation logs the task's nDCG@10 (x100) under dev_ndcg_at_10, the checkpoint
    with the best one is exported, and that model scores the same on the task when scored again here. The task: the
    tiny NLI premises retrieving their entailments among every hypothesis, so training moves the score."""
    from mlflow import MlflowClient

    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.retrieval import dev_ndcg_at_10, read_dev_set
    from tests.evaluation.test_retrieval import write_beir
    from training.run import run_training

    rows = [json.loads(line) for line in TINY_NLI.read_text().splitlines()]
    docs = {f"d{i}": t for i, t in enumerate(dict.fromkeys(r["text2"] for r in rows))}
    doc_of, premises = {t: d for d, t in docs.items()}, list(dict.fromkeys(r["text1"] for r in rows))
    qrels = [(f"q{premises.index(r['text1'])}", doc_of[r["text2"]], 1) for r in rows if r["label"] == "entailment"]
    folder = write_beir(tmp_path / "nli-dev", docs, {f"q{i}": t for i, t in enumerate(premises)}, qrels)
    out = run_training(tiny_config(train_env, "retrieval-dev", f"eval.dev_retrieval={folder}", "trainer.max_steps=3",
                                   "trainer.eval_every=1", "trainer.global_batch_size=16", "trainer.lr=3e-3"))
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
