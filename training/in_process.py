"""``trainer.num_workers=0``: the training loop in the job's own process, through Ray Train's local mode.

A one-worker Ray Train run starts a controller actor and a worker actor, and the worker imports the model stack and
the MLflow client again (about 12 s on a 2-core node before its first step, training/run.py's notes). Run in process,
the same ``train_loop_per_worker`` sees the same world (rank 0 of 1, on a one-process gloo or NCCL group, as Ray
Train opens for one worker), so it trains the same model step for step.

Ray Train's local mode keeps only the last report; what its controller does with checkpoints is done here by
``CheckpointKeeper``: each reported checkpoint is copied to the run folder (local or object storage), the best
``trainer.keep_checkpoints`` by the dev score (and the latest) are kept, the others deleted, and a record beside them
lets a resubmitted run name resume from the latest. A run folder written by the other mode is refused: neither reads
the other's record.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

RECORD = "in_process_checkpoints.json"  # beside the checkpoints, as Ray Train's checkpoint_manager_snapshot.json
RAY_TRAIN_RECORD = "checkpoint_manager_snapshot.json"

_active: CheckpointKeeper | None = None  # the keeper of the run training in this process, if any


class CheckpointKeeper:
    """Ray Train's checkpoint bookkeeping for a run in this process: ``keep`` the best by ``score`` (ties: the later),
    and always the latest; without a score, the latest ``keep``."""

    def __init__(self, run_folder: str, keep: int, score: str | None):
        import pyarrow.fs

        from storage.paths import absolute

        self.fs, self.root = pyarrow.fs.FileSystem.from_uri(absolute(run_folder))
        self.run_folder, self.keep, self.score = run_folder, keep, score
        self.kept: list[tuple[str, dict[str, Any]]] = self._read_record()
        self.last_metrics: dict[str, Any] | None = None

    def report(self, metrics: dict[str, Any], folder: Path | None, name: str) -> None:
        """One report of the loop: its metrics, and its checkpoint folder copied to the run folder (then the record
        rewritten: a checkpoint is listed once it is whole)."""
        import pyarrow.fs

        from storage.paths import join, remove_tree, storage_path

        self.last_metrics = metrics
        if folder is None:
            return
        target = f"{self.root}/{name}"
        pyarrow.fs.copy_files(str(folder), target, source_filesystem=pyarrow.fs.LocalFileSystem(),
                              destination_filesystem=self.fs)
        self.kept.append((name, metrics))
        for gone in self._pruned():  # (pyarrow's delete_dir would leave a folder marker on object storage)
            remove_tree(storage_path(join(self.run_folder, gone)))
        with self.fs.open_output_stream(f"{self.root}/{RECORD}") as out:
            out.write(json.dumps({"checkpoints": [{"name": n, "metrics": m} for n, m in self.kept]}).encode())

    def latest(self):
        """The checkpoint to resume from (ray.train.Checkpoint), None before the first."""
        import ray.train

        return ray.train.Checkpoint(f"{self.root}/{self.kept[-1][0]}", self.fs) if self.kept else None

    def result(self):
        """What ``TorchTrainer.fit`` returns for the run: the last metrics, the kept checkpoints with theirs."""
        import ray.train

        kept = [(ray.train.Checkpoint(f"{self.root}/{n}", self.fs), m) for n, m in self.kept]
        return ray.train.Result(metrics=self.last_metrics, checkpoint=kept[-1][0] if kept else None, error=None,
                                path=self.root, best_checkpoints=kept, _storage_filesystem=self.fs)

    def _pruned(self) -> list[str]:
        """Drop from ``kept`` what falls out of it; returns the names dropped."""
        order = range(len(self.kept))
        if self.score:
            order = sorted(order, key=lambda i: (self.kept[i][1].get(self.score, float("-inf")), i))
        keep = set(list(order)[-self.keep:]) | {len(self.kept) - 1}
        gone = [n for i, (n, _) in enumerate(self.kept) if i not in keep]
        self.kept = [c for i, c in enumerate(self.kept) if i in keep]
        return gone

    def _read_record(self) -> list[tuple[str, dict[str, Any]]]:
        import pyarrow.fs

        if self.fs.get_file_info(f"{self.root}/{RECORD}").type == pyarrow.fs.FileType.NotFound:
            return []
        with self.fs.open_input_stream(f"{self.root}/{RECORD}") as f:
            return [(c["name"], c["metrics"]) for c in json.loads(f.read())["checkpoints"]]


def refuse_the_other_mode(run_folder: str, in_process: bool) -> None:
    """Neither mode reads the other's record of its checkpoints: a run folder written by the other is refused (else
    the run would start over beside them)."""
    from storage.paths import join, storage_path

    if in_process and storage_path(join(run_folder, RAY_TRAIN_RECORD)).exists():
        raise ValueError(f"{run_folder} holds a run of Ray Train workers: resume it with trainer.num_workers >= 1, "
                         f"or give a new tracking.run_name to train in process (trainer.num_workers=0)")
    if not in_process and storage_path(join(run_folder, RECORD)).exists():
        raise ValueError(f"{run_folder} holds a run trained in process (trainer.num_workers=0): resume it with "
                         f"trainer.num_workers=0, or give a new tracking.run_name")


def active_keeper() -> CheckpointKeeper | None:
    return _active


def starting_checkpoint():
    """The checkpoint a starting loop resumes from: the keeper's latest in process, else Ray Train's."""
    if _active is not None:
        return _active.latest()
    import ray.train

    return ray.train.get_checkpoint()


def fit_in_process(train_loop, worker_config, run_name: str, keeper: CheckpointKeeper, use_gpu: bool):
    """``train_loop(worker_config)`` here, through Ray Train's local mode (``ScalingConfig(num_workers=0)``: the
    ``ray.train`` context and reports of one worker), on a one-process group; returns Ray Train's Result form."""
    global _active
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_loop, train_loop_config=worker_config,
                           scaling_config=ray.train.ScalingConfig(num_workers=0),
                           run_config=ray.train.RunConfig(name=run_name))
    threads = torch.get_num_threads()  # the loop sets its own (trainer.threads_per_worker)
    _active = keeper
    try:
        with _one_process_group("nccl" if use_gpu else "gloo"):
            trainer.fit()
    finally:
        _active = None
        torch.set_num_threads(threads)
    return keeper.result()


@contextlib.contextmanager
def _one_process_group(backend: str):
    """The group Ray Train opens for one worker, here: a world of one, so every strategy (DeepSpeed too) runs as on a
    one-worker group. Ray's local mode destroys it when the loop returns."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("trainer.num_workers=0 trains in this process, which is already in a torch.distributed "
                           "group: run the job on its own, or set trainer.num_workers >= 1")
    # What Ray Train sets in a worker and DeepSpeed reads (not MASTER_ADDR: Ray's local mode would open a group itself)
    ranks = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in ranks}
    os.environ.update(ranks)
    try:
        with _group(backend):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _group(backend: str):
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            if dist.is_initialized():  # the loop failed before Ray's local mode could
                dist.destroy_process_group()
