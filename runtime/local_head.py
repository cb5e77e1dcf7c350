"""A local `ray start --head` on loopback and `ray job submit` against it, as a user would run them (the demo and
the submit-latency benchmark)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from runtime.local_ray import LOCAL_SYSTEM_CONFIG, SAFE_LOCAL_ENV

VENV_BIN = Path(sys.executable).parent
# Ray's job API answers this while the head's job agent has not registered yet (its wait is 10 s, which a busy
# 2-core machine can exceed right after `ray start`). Nothing was started, so the submission can be repeated.
AGENT_NOT_READY = "No available agent to submit job"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for the `ray` CLI: loopback-only, no auth, this venv's `python` first on PATH
    (job entrypoints say `python`), never an inherited RAY_ADDRESS."""
    env = {**os.environ, **SAFE_LOCAL_ENV, **(extra or {})}
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class LocalHead:
    """`ray start --head` bound to 127.0.0.1 on free ports for the length of a `with` block; `ray stop` after."""

    def __init__(self, env: dict[str, str], num_cpus: int = 2):
        self.env, self.num_cpus = env, num_cpus
        self.dashboard = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard}"
        self.returncode: int | None = None

    def __enter__(self) -> LocalHead:
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(free_port()),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard),
               "--num-cpus", str(self.num_cpus), "--disable-usage-stats",
               "--system-config", json.dumps(LOCAL_SYSTEM_CONFIG)]
        subprocess.run(cmd, env=self.env, check=True, stdout=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([str(VENV_BIN / "ray"), "stop"], env=self.env, stdout=subprocess.DEVNULL, check=False)

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
