import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_NLI = ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl"


@pytest.fixture(scope="package")
def train_env(tmp_path_factory):
    """A private MLflow store and run storage for the training tests, on the shared local Ray (2 CPUs)."""
    from tests.conftest import mlflow_store, shared_ray

    root = tmp_path_factory.mktemp("train")
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS")}
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_store(root)
    os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(root / "artifacts")
    shared_ray()
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_config(root: Path, name: str, *overrides: str, stage: str = "stage1"):
    """configs/tiny/<stage>.yaml with test paths: no dev evaluation unless asked, dropout 0."""
    from jobconfig import load_config
    from jobconfig.schema import Stage2JobConfig, TrainJobConfig

    model = Stage2JobConfig if stage == "stage2" else TrainJobConfig
    base = [f"tracking.run_name={name}", f"trainer.storage_path={root / 'runs'}", f"output_dir={root / 'models'}",
            f"eval.data_dir={root / 'no-dev-data'}", "model.dropout=0.0", "tracking.experiment=raoe-test",
            "data.cache=false"]  # each run validates its corpus; the cache has tests of its own
    if stage == "stage1":
        base.append(f"data.train={TINY_NLI}")
    return load_config(model, ROOT / "configs" / "tiny" / f"{stage}.yaml", base + list(overrides))


# Two runs from the same weights on the same rows, summed in another order (1 vs 2 workers, ZeRO vs DDP,
# replayed on fewer workers): equal to float32 precision. Measured 3e-7 to 1.05e-5 relative across CPUs and
# BLAS kernels (the larger where the gradient norm is ~12 and its parts cancel); a different batch, a dropout
# mask drawn differently or a gradient off by x2 moves these numbers by 1-50%.
SAME_START_REL = 1e-4
# ... and one AdamW step later: Adam moves a weight by ~lr * sign(g), and where |g| is ~1e-7 two summation
# orders can flip that sign (measured: up to 1.3e-3 relative at step 2).
ONE_STEP_APART_REL = 5e-3


def metric_by_step(run_id: str, key: str) -> dict[int, float]:
    """A run's per-step metric from MLflow (the value logged last for a step that ran twice)."""
    from mlflow import MlflowClient

    history = sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in history}


def stsb_dev_folder(root: Path, pairs: int = 24) -> Path:
    """A SentEval-layout root holding an STS-B dev of the first tiny NLI pairs, gold from their similarity S."""
    import json

    rows = [json.loads(line) for line in TINY_NLI.read_text().splitlines()[:pairs]]
    folder = root / "STS" / "STSBenchmark"
    folder.mkdir(parents=True)
    (folder / "sts-dev.csv").write_text("".join(
        f"main-captions\tMSRvid\t2012test\t{i:04d}\t{5 * r['similarity']:.3f}\t{r['text1']}\t{r['text2']}\n"
        for i, r in enumerate(rows)))
    return root


@pytest.fixture(scope="package")
def simcse_retrieval_dev_run(train_env, tmp_path_factory):
    """One tiny SimCSE run that two modules check (a run costs ~20 s of start-up): InfoNCE on NLI triplets
    (test_simcse_training: it trains on triplets) selecting its checkpoints by a retrieval dev task (test_dev_selection):
    the tiny NLI premises retrieving their entailments among every hypothesis, so training moves the score. It trains
    in the test's process (trainer.num_workers=0), where raoe, not Ray Train's controller, keeps the best checkpoints.
    Queries and documents have their own prompts and the queries their own length (model.prompts, query_max_length).
    Returns (the run's result, the dev task's BEIR folder)."""
    import json

    from tests.evaluation.test_retrieval import write_beir
    from training.run import run_training

    rows = [json.loads(line) for line in TINY_NLI.read_text().splitlines()]
    docs = {f"d{i}": t for i, t in enumerate(dict.fromkeys(r["text2"] for r in rows))}
    doc_of, premises = {t: d for d, t in docs.items()}, list(dict.fromkeys(r["text1"] for r in rows))
    qrels = [(f"q{premises.index(r['text1'])}", doc_of[r["text2"]], 1) for r in rows if r["label"] == "entailment"]
    folder = write_beir(tmp_path_factory.mktemp("nli-dev") / "nli-dev", docs,
                        {f"q{i}": t for i, t in enumerate(premises)}, qrels, split="dev")
    out = run_training(tiny_config(train_env, "simcse-retrieval-dev", "data.triplets=true",
                                   "objective.weights={infonce: 1.0}", f"eval.dev_retrieval={folder}",
                                   "trainer.max_steps=3", "trainer.eval_every=1", "trainer.global_batch_size=16",
                                   "trainer.lr=3e-3", "model.prompts={query: 'query: ', document: 'passage: '}",
                                   "model.query_max_length=12",
                                   "trainer.num_workers=0"))  # in this process: raoe keeps the best checkpoints
    return out, folder
