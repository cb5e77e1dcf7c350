"""Ray Train's torch process group (gloo on CPU, NCCL on GPUs), set up by a controller that never imports torch.

Ray Train's ``TorchConfig`` and ``TorchTrainer`` live in modules that import torch at their top, so a run's driver
(which only builds the trainer) and its controller (which only unpickles the config and tells the workers what to
call) import torch too: about 2 s of CPU each here, in series before any worker starts, on every run.
``ProcessGroupConfig`` is that config with the same fields in a module without torch, for Ray Train's
``DataParallelTrainer``: the workers run Ray Train's own set-up, context and shut-down functions, which they import by
name where torch is loaded anyway. What raoe never uses (TPU slices, the ``tcp`` init method) is not offered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig


@dataclass
class ProcessGroupConfig(BackendConfig):
    """``ray.train.torch.TorchConfig``'s fields (``backend``: "gloo" or "nccl"; ``timeout_s``), the env init method."""

    backend: str = "gloo"
    timeout_s: int = 1800

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"process group backend {self.backend!r}: raoe runs 'gloo' (CPU) or 'nccl' (GPUs)")

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def train_func_context(self):
        return _WorkerDevice

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def _torch_config_call(name: str, **kwargs):
    """On a worker: Ray Train's own function ``ray.train.torch.config.<name>``."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


class _WorkerDevice:
    """Around the training function on each worker: Ray Train's own context (the worker's CUDA device made current),
    imported there, not by the driver that builds the training function."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._context = TorchConfigContextManager()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


class _ProcessGroupBackend(Backend):
    """What ``ray.train.torch.config._TorchBackend.on_start`` / ``on_shutdown`` do for gloo and NCCL with the env
    init method, each worker-side step Ray Train's own function."""

    share_cuda_visible_devices: bool = True  # as Ray's: NCCL sees every GPU of the run on its node

    def on_start(self, worker_group, backend_config: ProcessGroupConfig):
        import ray
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_torch_config_call, "_set_torch_distributed_env_vars")
        ray.get([worker_group.execute_single_async(
            rank, _torch_config_call, "_setup_torch_process_group", backend=backend_config.backend,
            world_rank=rank, world_size=len(worker_group), init_method="env://", timeout_s=backend_config.timeout_s)
            for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig):
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        futures = worker_group.execute_async(_torch_config_call, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = float(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                         DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            import logging

            logging.getLogger(__name__).warning(f"torch process group shutdown timed out after {timeout_s} s")
