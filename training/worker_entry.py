"""The function Ray Train's workers run, named in a module without torch: the driver hands it to the trainer without
importing training.loop (torch, the encoder stack: about 2 s of CPU in series before the workers start); each
worker imports that on its first call, as it would to unpickle the loop itself."""

from __future__ import annotations

from training.worker_config import WorkerConfig


def train_on_worker(worker_config: WorkerConfig) -> None:
    from training.loop import train_loop_per_worker

    train_loop_per_worker(worker_config)
