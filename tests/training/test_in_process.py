"""trainer.num_workers=0: training in the job's own process (Ray Train's local mode). That it trains the one-worker
run step for step is shown where the one-worker baselines train in process: every two-worker run of test_distributed,
test_relational, test_unsupervised, test_posttrain and test_qlora is compared with one. Here: what raoe does in place
of Ray Train's controller (checkpoints kept by score and the latest, their record, on local and object storage; a
resubmitted run resuming from them), and what it refuses."""

import json
from pathlib import Path

import pytest

from tests.training.conftest import SAME_START_REL, metric_by_step, tiny_config


def _checkpoint_folder(tmp_path, step: int):
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    (folder / "model").mkdir()
    (folder / "model" / "weights.bin").write_bytes(bytes([step]) * 64)
    return folder


def _entries(folder) -> list[str]:
    """The names at the top of a folder that hold files (object storage also lists folder markers)."""
    from storage.paths import files_under

    return sorted({name.split("/")[0] for name, _, _ in files_under(folder)})


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_keeper_keeps_the_best_by_score_and_the_latest(tmp_path, where, request):
    """Five reports scored 0.3, 0.9, 0.1, 0.5, 0.2 with keep_checkpoints 2: the two best (steps 2 and 4) and the
    latest (5) stay on the storage, listed in the record a resubmitted run reads; without a score, the latest two."""
    from storage.paths import storage_path
    from training.in_process import RECORD, CheckpointKeeper
    from training.run import _best

    root = str(tmp_path / "runs") if where == "local" else request.getfixturevalue("s3").uri("runs")
    keeper = CheckpointKeeper(f"{root}/scored", keep=2, score="dev")
    keeper.report({"step": 0, "dev": None}, None, "no-checkpoint")  # metrics only: nothing written
    for step, score in enumerate([0.3, 0.9, 0.1, 0.5, 0.2], 1):
        keeper.report({"step": step, "dev": score}, _checkpoint_folder(tmp_path, step), f"checkpoint_{step}")
    on_storage = storage_path(f"{root}/scored")
    assert _entries(on_storage) == ["checkpoint_2", "checkpoint_4", "checkpoint_5", RECORD]
    assert on_storage.joinpath("checkpoint_4", "model", "weights.bin").read_bytes() == bytes([4]) * 64
    result = keeper.result()
    assert [m["step"] for _, m in result.best_checkpoints] == [2, 4, 5] and result.metrics["step"] == 5
    best, metrics = _best(result, "dev")
    assert metrics["step"] == 2
    with best.as_directory() as folder:  # what the driver exports
        assert (Path(folder) / "model" / "weights.bin").read_bytes() == bytes([2]) * 64

    again = CheckpointKeeper(f"{root}/scored", keep=2, score="dev")  # a resubmitted run reads the record
    assert [m["step"] for _, m in again.kept] == [2, 4, 5]
    assert again.latest().path.endswith("scored/checkpoint_5")

    latest = CheckpointKeeper(f"{root}/unscored", keep=2, score=None)
    for step in range(1, 5):
        latest.report({"step": step}, _checkpoint_folder(tmp_path, step), f"checkpoint_{step}")
    assert _entries(storage_path(f"{root}/unscored")) == ["checkpoint_3", "checkpoint_4", RECORD]


def test_a_run_folder_of_the_other_mode_is_refused(tmp_path):
    """Neither mode reads the other's record of checkpoints: resuming across them would start over beside them."""
    from training.in_process import RECORD, refuse_the_other_mode

    ray_run, local_run = tmp_path / "ray-run", tmp_path / "local-run"
    ray_run.mkdir()
    (ray_run / "checkpoint_manager_snapshot.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a run of Ray Train workers: resume it with trainer.num_workers >= 1"):
        refuse_the_other_mode(str(ray_run), in_process=True)
    local_run.mkdir()
    (local_run / RECORD).write_text(json.dumps({"checkpoints": []}))
    with pytest.raises(ValueError, match=r"trained in process \(trainer.num_workers=0\): resume it with"):
        refuse_the_other_mode(str(local_run), in_process=False)
    refuse_the_other_mode(str(ray_run), in_process=False)  # each mode goes on in its own folder
    refuse_the_other_mode(str(local_run), in_process=True)


class _FailAfterStep:
    """The run fails after ``step`` (an exception in the loop), once."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, *, step: int, rank: int, world: int, resumed: bool) -> None:
        if step == self.step and not resumed:
            raise RuntimeError(f"injected failure after step {step}")


def test_a_failed_run_in_process_resumes_from_its_last_checkpoint(train_env):
    """A run that fails after step 3 (checkpoints at 2) leaves no process group behind; submitted again under its
    name it resumes after step 2 in the same MLflow run and trains step 3 again from the same weights and rows."""
    import torch.distributed as dist

    from training.run import run_training

    steps = ("trainer.num_workers=0", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.global_batch_size=16",
             "model.dropout=0.1")
    with pytest.raises(RuntimeError, match="injected failure after step 3"):
        run_training(tiny_config(train_env, "in-process-resumed", *steps), after_step=(_FailAfterStep(3),))
    assert not dist.is_initialized()
    again = run_training(tiny_config(train_env, "in-process-resumed", *steps))
    assert again["resumed"] is True and again["metrics"]["steps"] == 4 and again["num_workers"] == 0
    from mlflow import MlflowClient

    history = MlflowClient().get_metric_history(again["run_id"], "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 3, 4]
    first, replayed = [m.value for m in history if m.step == 3]
    assert replayed == pytest.approx(first, rel=SAME_START_REL)
    assert metric_by_step(again["run_id"], "grad_norm")[4] > 0
    assert "(1 worker, in the job's process, ddp)" in (Path(again["model_path"]) / "README.md").read_text()


def test_what_cannot_run_in_process_is_refused_by_key(train_env):
    """Restarts need a worker group; a GPU in process must be this process's; a negative count is no count."""
    import torch

    from jobconfig.loader import ConfigError
    from training.run import preflight

    with pytest.raises(ConfigError, match="trainer.max_failures=1 restarts a worker group"):
        tiny_config(train_env, "refused", "trainer.num_workers=0", "trainer.max_failures=1")
    with pytest.raises(ConfigError, match=r"must be a count >= 1, 0 \(train in the job's process\)"):
        tiny_config(train_env, "refused", "trainer.num_workers=-1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="trainer.use_gpu with trainer.num_workers=0 .* sees none"):
            preflight(tiny_config(train_env, "refused", "trainer.num_workers=0", "trainer.use_gpu=true"))
