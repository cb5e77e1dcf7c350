"""Fault injection for the recovery tests. Production runs install no hook; a test passes one to ``run_training``
(``after_step=(KillWorkerAfterStep(4),)``), and every worker calls it after each optimizer step."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


def report_collected_s() -> float:
    """How long a worker waits before its fault so that Ray Train's controller has collected its last report: 2.5
    polls of the controller (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, Ray's default 2 s; the tests poll every 0.2 s), and
    at least 2 s for a loaded machine."""
    return max(2.0, 2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))


@dataclass(frozen=True)
class KillWorkerAfterStep:
    """The last worker SIGKILLs its own process after ``step``, once: not again in the group Ray Train restarts, which
    resumes from a checkpoint."""

    step: int

    def __call__(self, *, step: int, rank: int, world: int, resumed: bool) -> None:
        if resumed or step != self.step or rank != world - 1:
            return
        # Ray Train's controller collects reported checkpoints on its health-check poll; a worker that dies within
        # that window loses its last report. Wait, as any real run would between reports.
        time.sleep(report_collected_s())
        print(f"[raoe] fault injection: killing worker {rank} (pid {os.getpid()}) after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class PauseAfterStep:
    """Every worker sleeps ``seconds`` after ``step`` (its checkpoint reported), once: not in a run that resumed. A
    window in which a test's own fault (a lost node, a killed driver) lands between two known steps, however fast the
    machine trains."""

    step: int
    seconds: float

    def __call__(self, *, step: int, rank: int, world: int, resumed: bool) -> None:
        if not resumed and step == self.step:
            time.sleep(self.seconds)


@dataclass(frozen=True)
class ShrinkAfterStep:
    """Elastic runs: after ``step`` the last worker has a placeholder actor claim ``cpus`` of the cluster for
    ``hold_s`` seconds (queued until the group frees them), then SIGKILLs its own process, once: Ray Train restarts
    the group with the workers that still fit."""

    step: int
    cpus: float
    hold_s: float = 120.0

    def __call__(self, *, step: int, rank: int, world: int, resumed: bool) -> None:
        if resumed or step != self.step or rank != world - 1:
            return
        import ray

        placeholder = ray.remote(num_cpus=self.cpus)(_Placeholder).options(lifetime="detached").remote()
        placeholder.hold.remote(self.hold_s)
        time.sleep(5)  # as KillWorkerAfterStep: the controller collects the last report first (on Ray's 2 s poll)
        print(f"[raoe] fault injection: {self.cpus} CPUs claimed, killing worker {rank} after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class _Placeholder:
    def hold(self, seconds: float) -> None:
        import ray

        time.sleep(seconds)
        ray.actor.exit_actor()
