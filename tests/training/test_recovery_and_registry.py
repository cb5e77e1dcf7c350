"""Recovery: a resubmitted run name resumes, passing over a checkpoint that is not whole (a killed worker inside a
run: test_exact_resume.py), on another worker count with dropout on; Stage 2 starts from a registered Stage 1 model
by its MLflow URI."""

import csv
import json

import numpy as np
import pytest
import ray.train

from tests.training.conftest import ONE_STEP_APART_REL, SAME_START_REL, TINY_NLI, tiny_config
from training.faults import KillWorkerAfterStep

STEPS = ("data.max_rows=64", "trainer.global_batch_size=16", "trainer.max_steps=5", "trainer.eval_every=2",
         "data.cache=true",  # the resubmission reads the corpus its first submission validated
         "trainer.chunk_size=8", "model.dropout=0.1")  # 2 workers x 1 chunk first, then 1 worker x 2 chunks


def _logged_steps(run_id: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient().get_metric_history(run_id, "train_loss"))


@pytest.fixture(scope="module")
def resubmitted(train_env):
    """A run on 2 workers whose worker dies after step 4 with no restarts allowed (the job fails), its step-4
    checkpoint then truncated on disk (a half-written file), and the same run name submitted again on 1 worker.
    About 65 s here: two groups of Ray Train workers start, the failed run's two and the resubmission's one."""
    from training.run import run_training

    with pytest.raises(ray.train.TrainingFailedError):  # no restarts allowed: the job fails after step 4
        run_training(tiny_config(train_env, "resubmitted", *STEPS, "trainer.num_workers=2"),
                     after_step=(KillWorkerAfterStep(4),))
    latest = max((p for p in (train_env / "runs" / "resubmitted").glob("checkpoint_*") if p.is_dir()),
                 key=lambda p: p.name)
    assert json.loads((latest / "progress.json").read_text())["step"] == 4
    weights = latest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return run_training(tiny_config(train_env, "resubmitted", *STEPS, "trainer.num_workers=1"))


def test_resubmitting_a_run_name_resumes_it_from_its_last_whole_checkpoint(resubmitted):
    from mlflow import MlflowClient

    assert resubmitted["resumed"] is True and resubmitted["metrics"]["steps"] == 5
    assert resubmitted["corpus_cache"] == "read"  # from the failed first submission's validation
    # one MLflow run, continued from step 2: the truncated step-4 checkpoint was passed over
    assert _logged_steps(resubmitted["run_id"]) == [1, 2, 3, 3, 4, 4, 5]
    history = MlflowClient().get_metric_history(resubmitted["run_id"], "train_loss")
    first, again = [m.value for m in history if m.step == 3]  # replayed on 1 worker from the 2 workers' weights
    assert again == pytest.approx(first, rel=SAME_START_REL)
    first, again = [m.value for m in history if m.step == 4]  # after one AdamW step summed in another order
    assert again == pytest.approx(first, rel=ONE_STEP_APART_REL)


def test_a_run_name_resubmitted_on_other_rows_is_refused_before_training(train_env, resubmitted):
    """Its checkpoints record the corpus fingerprint; another data.max_rows is other rows: refused, naming the keys,
    before any worker starts (no checkpoint or MLflow step is added)."""
    from training.run import run_training

    def latest_checkpoint():
        return max((p for p in (train_env / "runs" / "resubmitted").glob("checkpoint_*") if p.is_dir()),
                   key=lambda p: p.name)

    latest = latest_checkpoint()
    recorded = json.loads((latest / "progress.json").read_text())["corpus"]
    assert len(recorded) == 16
    with pytest.raises(ValueError, match=rf"data.train=.*48 rows.*records {recorded}.*tracking.run_name"):
        run_training(tiny_config(train_env, "resubmitted", *STEPS, "trainer.num_workers=1", "data.max_rows=48"))
    assert latest_checkpoint() == latest
    assert _logged_steps(resubmitted["run_id"]) == [1, 2, 3, 3, 4, 4, 5]


def test_stage2_starts_from_the_registered_stage1_model(train_env, resubmitted, tmp_path, s3, monkeypatch):
    """Stage 2 from the registered Stage 1 URI with everything it writes on object storage (the local S3 endpoint):
    the Ray Data tasks read its STS-B train file there and write the validated-corpus cache there, the run (in the
    test's process, trainer.num_workers=0) checkpoints there with its record of them (Ray Train's workers do:
    test_multinode.py), the best model is exported there and MLflow keeps the registered model's artifacts there."""
    from mlflow import MlflowClient

    from encoders.backbone import inference_embeddings, load_encoder
    from encoders.model_uris import download_model
    from storage.paths import storage_path
    from training.run import run_training

    rows = [json.loads(line) for line in TINY_NLI.read_text().splitlines()][:64]
    sts = tmp_path / "sts-train.csv"
    with open(sts, "w", newline="") as f:
        csv.writer(f).writerows([r["text1"], r["text2"], round(5 * r["similarity"], 2)] for r in rows)

    s1_uri = resubmitted["model_uri"]
    assert s1_uri.startswith("models:/raoe-s1/")
    texts = [r["text2"] for r in rows[:8]]
    np.testing.assert_allclose(inference_embeddings(load_encoder(download_model(s1_uri)), texts),
                               inference_embeddings(load_encoder(resubmitted["model_path"]), texts), atol=1e-6)

    on_s3 = s3.upload(sts, "stsb/sts-train.csv")
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", s3.uri("mlartifacts"))  # for experiments created from now on
    s2 = run_training(tiny_config(train_env, "stage2-from-uri", f"data.train={on_s3}", f"model.init_from={s1_uri}",
                                  "trainer.global_batch_size=16", "trainer.max_steps=2", "data.cache=true",
                                  f"trainer.storage_path={s3.uri('runs')}", f"output_dir={s3.uri('models')}",
                                  "tracking.experiment=raoe-test-on-s3", "trainer.num_workers=0", stage="stage2"))
    assert s2["registered_model"] == "raoe-s2" and s2["model_uri"] == f"models:/raoe-s2/{s2['version']}"
    assert (s2["rows_in"], s2["rows_written"], s2["corpus_cache"]) == (64, 64, "written")
    assert s2["checkpoint_path"] == s3.uri("runs/stage2-from-uri")
    record = json.loads(storage_path(s2["checkpoint_path"]).joinpath("in_process_checkpoints.json").read_text())
    assert [c["metrics"]["step"] for c in record["checkpoints"]] == [2]  # eval_every 4: the last step's
    assert storage_path(s2["checkpoint_path"]).joinpath(record["checkpoints"][0]["name"], "model").is_dir()
    assert s2["model_path"] == s3.uri("models/stage2-from-uri/model")
    exported = storage_path(s2["model_path"])
    assert {"modules.json", "model.safetensors", "README.md"} <= {p.name for p in exported.iterdir()}
    assert (exported.parent / "config.json").exists()
    assert any(p.name == "MLmodel" for p in storage_path(s3.uri("mlartifacts")).rglob("*"))  # MLflow's artifacts
    s2_model = download_model(s2["model_uri"])  # read back from the bucket through the registry
    assert storage_path(s2_model).joinpath("model.safetensors").read_bytes() == \
        exported.joinpath("model.safetensors").read_bytes()
    client = MlflowClient()
    version = client.get_model_version("raoe-s2", str(s2["version"]))
    assert version.tags["start_model"] == s1_uri and version.tags["raoe.stage"] == "stage2"
    assert version.tags["data"] == on_s3
    assert {m.name for m in client.search_registered_models()} >= {"raoe-s1", "raoe-s2"}
    assert not np.allclose(inference_embeddings(load_encoder(s2_model), texts),
                           inference_embeddings(load_encoder(resubmitted["model_path"]), texts), atol=1e-4)
