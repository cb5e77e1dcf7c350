"""Exact resume: a Ray Train worker process SIGKILLed from outside mid-run (max_failures > 0) costs only time.
The run ends on the configured step with the same weights and the same last loss as an uninterrupted run, with
gradient accumulation, an epoch whose rows the global batch does not divide (120 rows, 32 per step), resume
points inside an epoch, and dropout on (masks are drawn from seed, step and chunk), for DDP and
DeepSpeed. The killed run keeps its checkpoints on object storage (the local S3 endpoint): the restarted workers
resume from there. Its workers also map the corpus from the node's copy of its files on that storage
(data.node_local), the uninterrupted run's from Ray's object store: the same rows at every step either way."""

import contextlib
import json
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.training.conftest import metric_by_step, tiny_config

STEPS = 9
COMMON = ("data.max_rows=120", "trainer.num_workers=2", "trainer.global_batch_size=32", "trainer.grad_accum=2",
          f"trainer.max_steps={STEPS}", "trainer.eval_every=2", "trainer.lr=1e-3", "model.dropout=0.1")
STRATEGIES = {"ddp": ("trainer.strategy=ddp",), "zero-2": ("trainer.strategy=deepspeed", "trainer.zero_stage=2")}


def _train_workers() -> list[psutil.Process]:
    """This session's Ray Train workers: the local Ray is this process's child (another xdist worker runs its own)."""
    workers = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (process.cmdline() or [""])[0].startswith("ray::RayTrainWorker"):
                workers.append(process)
    return workers


def _kill_a_worker_after(run_name: str, step: int, timeout: float = 600) -> dict:
    """From another thread: once MLflow shows ``step`` logged for the run, SIGKILL one Ray Train worker process."""
    from mlflow import MlflowClient

    seen: dict = {}

    def watch():
        client, deadline = MlflowClient(), time.time() + timeout
        while time.time() < deadline:
            runs = client.search_runs([client.get_experiment_by_name("raoe-test").experiment_id],
                                      f"tags.`mlflow.runName` = '{run_name}'") if client.get_experiment_by_name(
                                          "raoe-test") else []
            if runs and any(m.step >= step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")):
                workers = _train_workers()
                if workers:
                    seen["pid"] = workers[-1].pid
                    workers[-1].kill()
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    seen["thread"] = thread
    return seen


# DDP in make test; the DeepSpeed variant (the same contract, 75 s more) with the fault matrix's long variants
@pytest.fixture(scope="module", params=["ddp", pytest.param("zero-2", marks=pytest.mark.reliability)])
def resumed(request, train_env, s3_server):
    """The uninterrupted run and the killed one. About 120 s here: three groups of two Ray Train workers start (the
    uninterrupted run, the killed run, and its restart after the kill)."""
    from tests.conftest import new_bucket
    from training.run import run_training

    name, extra = request.param, STRATEGIES[request.param]
    reference = run_training(tiny_config(train_env, f"uninterrupted-{name}", *COMMON, *extra))
    killer = _kill_a_worker_after(f"killed-{name}", 5)
    bucket = new_bucket(s3_server, f"exact-resume-{name}")
    killed = run_training(tiny_config(train_env, f"killed-{name}", *COMMON, *extra, "trainer.max_failures=2",
                                      f"trainer.storage_path={bucket.uri('runs')}", "data.node_local=true"))
    assert killed["checkpoint_path"] == bucket.uri(f"runs/killed-{name}")
    from storage.paths import storage_path

    assert len(list(storage_path(bucket.uri("runs/corpus_files")).glob("*/corpus.json"))) == 1  # node-local files
    killer["thread"].join(timeout=5)
    return reference, killed, killer.get("pid")


def test_a_killed_worker_costs_only_time(resumed):
    reference, killed, pid = resumed
    assert pid is not None, "no Ray Train worker was killed"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    logged = metric_by_step(killed["run_id"], "train_loss")
    from mlflow import MlflowClient

    all_logged = [m.step for m in MlflowClient().get_metric_history(killed["run_id"], "train_loss")]
    assert len(all_logged) > STEPS, f"no step ran twice, so no restart happened: {sorted(all_logged)}"
    assert sorted(logged) == list(range(1, STEPS + 1)) and killed["metrics"]["steps"] == STEPS
    assert killed["plan"]["steps_per_epoch"] == 3  # 120 rows / 32: resume points at steps 4 and 6 are mid-epoch

    expected = metric_by_step(reference["run_id"], "train_loss")
    for step in range(1, STEPS + 1):  # replayed steps and the steps after them alike
        assert logged[step] == pytest.approx(expected[step], abs=1e-5), f"loss at step {step}"
    assert killed["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], abs=1e-5)
    a, b = (load_file(f"{r['model_path']}/model.safetensors") for r in (reference, killed))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, f"weights differ by {worst}"


def test_a_run_without_dev_scores_no_checkpoint_and_exports_its_latest(resumed):
    """No dev set (the uninterrupted run: checkpoints at steps 2, 4, 6, 8 and 9, the latest 2 kept): no checkpoint
    is scored, and the latest is exported."""
    reference = resumed[0]
    assert reference["metrics"]["best_stsb_dev_spearman"] is None
    assert reference["metrics"]["best_step"] == STEPS and reference["metrics"]["steps"] == STEPS
    meta = json.loads((Path(reference["model_path"]) / "raoe_encoder.json").read_text())
    assert meta["step"] == STEPS and meta["stsb_dev_spearman"] is None
