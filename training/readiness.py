"""Every worker ready before the first collective, or an error that names the one that is not.

A worker loads its model (from a hub or the registry, per node) and maps its corpus rows (fetched from another node's
object store when its own holds none) before it joins the first collective (DDP's broadcast, DeepSpeed's set-up).
Without this check a slow or stuck worker shows up as NCCL's own timeout on the others, 30 minutes later and
naming no one. Here the workers meet at a gloo ``monitored_barrier`` with ``trainer.ready_timeout_s``: rank 0 raises
naming the ranks that did not arrive, and their nodes."""

from __future__ import annotations

import socket
import time
from datetime import timedelta


class Readiness:
    """Made at the start of the worker function (every worker arrives there together, when Ray Train starts the
    group), before any slow set-up; ``wait`` after it."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.started = time.perf_counter()
        self.group, self.hosts = None, [socket.gethostname()]
        if world > 1:
            import torch.distributed as dist

            # gloo whatever the training backend: monitored_barrier exists only there
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.hosts = [None] * world
            dist.all_gather_object(self.hosts, socket.gethostname(), group=self.group)

    def wait(self, what: str) -> float:
        """Block until every worker has finished ``what``; returns this worker's own set-up seconds."""
        took = time.perf_counter() - self.started
        if self.group is None:
            return took
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(self._not_ready(what, str(exc), took)) from None
        return took

    def _not_ready(self, what: str, error: str, took: float) -> str:
        late = sorted(int(r) for r in _ranks_in(error) if int(r) < self.world)
        if self.rank != 0 or not late:  # rank 0 names them; the others saw rank 0 give up
            return f"rank {self.rank} left the readiness barrier ({what}): {error.strip().splitlines()[0]}"
        named = ", ".join(f"rank {r} on {self.hosts[r]}" for r in late)
        return (f"{named} not ready {self.timeout_s:g} s after rank 0 ({what}; rank 0 took {took:.1f} s): look at "
                f"that node, or raise trainer.ready_timeout_s if its set-up is slow but moving")


def _ranks_in(error: str) -> list[str]:
    """The rank numbers in torch's message: "Ranks 1, 3 failed to pass monitoredBarrier" or "Rank 1 failed ..."."""
    import re

    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", error)
    return [r for r in re.split(r"[,\s]+", found.group(1)) if r] if found else []
