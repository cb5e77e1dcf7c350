"""Starting a Ray Train run loads torch in the workers only: the driver builds the trainer and its training function
without importing it (training/process_group.py; the controller's side is checked on a real two-worker run in
test_distributed.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BUILD_THE_TRAINER = """
import sys
import ray.train
from training.process_group import ProcessGroupConfig
from training.run import _ray_trainer
from training.worker_entry import train_on_worker

trainer = _ray_trainer(train_on_worker, train_loop_config={},
                       backend_config=ProcessGroupConfig(backend=sys.argv[1]),
                       scaling_config=ray.train.ScalingConfig(num_workers=2))
trainer._get_train_func()  # what fit() sends to the workers, with the process group's context around the loop
print(sorted(m for m in ("torch", "sentence_transformers", "deepspeed") if m in sys.modules))
"""


def test_the_driver_builds_a_run_without_importing_torch():
    out = subprocess.run([sys.executable, "-c", BUILD_THE_TRAINER, "nccl"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_backend_raoe_does_not_run_is_refused_by_name():
    from training.process_group import ProcessGroupConfig

    with pytest.raises(ValueError, match="'mpi'"):
        ProcessGroupConfig(backend="mpi")
    assert ProcessGroupConfig(backend="nccl").to_dict() == {"backend": "nccl", "init_method": "env",
                                                            "timeout_s": 1800}
