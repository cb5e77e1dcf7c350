"""Where a data job's model runs: the device of a Ray Data actor, and the resources its pool asks Ray for.

An actor pool that asks for GPUs (``num_gpus`` per actor) gets them reserved by Ray, which sets the actor's
``CUDA_VISIBLE_DEVICES`` to them: the actor's ``cuda`` is its own GPU. One that asks for none runs on CPU, and its
pool's arguments carry no ``num_gpus`` at all (Ray's default)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderPool:
    """A Ray Data actor pool that encodes: its size and what each actor reserves (GPUs > 0: the model on one)."""

    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0


def actor_device(num_gpus: float) -> str:
    """``cuda`` for an actor that reserved GPUs and can see one, else ``cpu`` (said once, not silently, when GPUs
    were asked for and CUDA is not there: a CPU build of torch, or a node without drivers)."""
    if num_gpus <= 0:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    print(f"[raoe] this actor reserved {num_gpus:g} GPU(s) but torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__}): running on CPU", flush=True)
    return "cpu"


def pool_resources(cpus_per_actor: float, gpus_per_actor: float) -> dict[str, float]:
    """``map_batches`` keyword arguments for an actor pool's resources per actor."""
    return {"num_cpus": cpus_per_actor, **({"num_gpus": gpus_per_actor} if gpus_per_actor > 0 else {})}


def shard_pool(actors: int):
    """A Ray Data actor pool whose every call is a whole shard (a corpus index's, an embedded file's: minutes of
    encoding on CPU), with one call in flight per actor, so that a shard waits for the next free actor. Ray Data's
    default lets an actor take a second call while it runs one: the first actor to load its model took both of a
    29,990-text corpus's shards, and the other actor of the pool sat idle through the 202 s build."""
    import ray

    return ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1)


def gpus_wanted_here(requests: dict[str, float]) -> None:
    """Refuse, before Ray starts, GPU requests (config key -> GPUs per actor) that the local Ray this job would start
    cannot meet: its pool would wait for them forever. A job submitted to a cluster (RAY_ADDRESS set) is not checked
    here: the cluster may have GPU nodes, or an autoscaler that adds them."""
    wanted = {key: gpus for key, gpus in requests.items() if gpus > 0}
    if not wanted or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, gpus in wanted.items():
        if have == 0 or gpus > have:
            raise ValueError(f"{key}={gpus:g} asks for GPUs, but this machine has {have} and the job starts its own "
                             f"local Ray: set it to 0, or submit the job to a cluster with GPU nodes")
