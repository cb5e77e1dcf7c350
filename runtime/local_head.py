"""A local `ray start --head` on loopback and `ray job submit` against it, as a user would run them (the demo and
the submit-latency benchmark)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from runtime.local_ray import LOCAL_SYSTEM_CONFIG, SAFE_LOCAL_ENV

VENV_BIN = Path(sys.executable).parent
# Ray's job API answers this while the head's job agent has not registered yet (its wait is 10 s, which a busy
# 2-core machine can exceed right after `ray start`). Nothing was started, so the submission can be repeated.
AGENT_NOT_READY = "No available agent to submit job"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1: each socket stays bound until all are taken (ports asked for one
    at a time may repeat, and a head given one port for two of its servers does not start)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def head_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for the `ray` CLI: loopback-only, no auth, this venv's `python` first on PATH
    (job entrypoints say `python`), never an inherited RAY_ADDRESS."""
    env = {**os.environ, **SAFE_LOCAL_ENV, **(extra or {})}
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class LocalHead:
    """`ray start --head --block` bound to 127.0.0.1 on free ports for the length of a `with` block, stopped by a
    signal after: this head, its workers and its jobs go, and any other Ray on the machine stays (`ray stop` would end
    every Ray the user runs, a test session's beside it too)."""

    START_TIMEOUT_S = 180

    def __init__(self, env: dict[str, str], num_cpus: int = 2):
        # Stopped at once: Ray's graceful drain would wait up to 30 s for running work first.
        self.env, self.num_cpus = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}, num_cpus
        self.dashboard, self._gcs_port, self._agent_port, self._client_port = free_ports(4)
        self.address = f"http://127.0.0.1:{self.dashboard}"
        self.gcs_address = f"127.0.0.1:{self._gcs_port}"  # where a node joins it
        # A temp dir of its own: Ray's job supervisor finds the cluster a job's driver joins through the newest cluster
        # in the head's temp dir, so in the shared /tmp/ray a Ray started later on this machine (a test's, a second
        # head) took this head's jobs.
        self.temp_dir: str | None = None
        self.returncode: int | None = None
        self._head: subprocess.Popen | None = None
        self._said: collections.deque[str] = collections.deque(maxlen=40)  # the head's last lines, for errors

    def __enter__(self) -> LocalHead:
        self.temp_dir = tempfile.mkdtemp(prefix="raoe-head-")
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--temp-dir", self.temp_dir,
               "--port", str(self._gcs_port), "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dashboard),
               # Ray's fixed defaults for these are taken when another Ray runs on the machine
               "--dashboard-agent-listen-port", str(self._agent_port),
               "--ray-client-server-port", str(self._client_port),
               "--num-cpus", str(self.num_cpus), "--disable-usage-stats",
               "--system-config", json.dumps(LOCAL_SYSTEM_CONFIG)]
        self._head = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)  # its own process group, stopped as one
        started = threading.Event()
        listener = threading.Thread(target=self._listen, args=(started,), daemon=True)
        listener.start()
        try:
            deadline = time.monotonic() + self.START_TIMEOUT_S
            while not started.wait(0.2):  # `ray start --block` says so once the head is up, then waits
                if self._head.poll() is not None or time.monotonic() > deadline:
                    why = self._why_not_up()
                    listener.join(timeout=5)  # the last lines of a head that exited
                    raise RuntimeError(f"`ray start --head` {why}:\n{''.join(self._said)}")
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _listen(self, started: threading.Event) -> None:
        for line in self._head.stdout:
            self._said.append(line)
            if "Ray runtime started" in line:
                started.set()

    def _why_not_up(self) -> str:
        code = self._head.poll()
        return f"exited with {code}" if code is not None else f"not up after {self.START_TIMEOUT_S} s"

    def _stop(self) -> None:
        """SIGTERM: `ray start --block` stops the processes it started (GCS, raylet, agents; workers and job drivers
        go with them); anything left in its process group after a minute is killed."""
        if self._head.poll() is None:
            self._head.terminate()
            try:
                self._head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._head.pid, signal.SIGKILL)
        self._head.wait()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def submit(self, entrypoint: list[str], runtime_env: dict, cwd: Path, attempts: int = 5) -> Iterator[str]:
        """`ray job submit --working-dir .` from ``cwd``; yields the output lines (the CLI's and the job's) as they
        come and leaves the CLI's exit code in ``self.returncode``. Repeats the submission while the head's job
        agent is not up yet."""
        cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", self.address, "--working-dir", ".",
               "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint]
        for attempt in range(1, attempts + 1):
            proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            agent_not_ready = False
            for line in proc.stdout:
                agent_not_ready = agent_not_ready or AGENT_NOT_READY in line
                yield line
            self.returncode = proc.wait()
            if self.returncode == 0 or not agent_not_ready or attempt == attempts:
                return
            print(f"[raoe] the Ray head's job agent is not up yet; submitting again ({attempt}/{attempts - 1})",
                  file=sys.stderr, flush=True)
            time.sleep(3)
