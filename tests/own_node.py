"""A Ray worker node on this machine with a disk and an environment of its own, as a cluster's other machines have:
``ray start --address ... --block`` inside its own mount namespace (``unshare -Urm``, unprivileged), with a fresh
tmpfs on /tmp (what its tasks write under /tmp, its node cache and Ray's session folder included, is invisible to
the head and the driver), its own HOME, and an environment holding only what a node of a real cluster holds:
credentials of its own (keys, as an instance role gives) and no AWS endpoint, region or profile setting. A job must
bring those settings to it (runtime.local_ray forwards the non-secret ones) and must never send it the driver's
profile, which names a section of a file only the driver's machine has."""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime.local_head import VENV_BIN
from runtime.local_ray import SAFE_LOCAL_ENV

NODE_CACHE = "/tmp/raoe-node"  # under the node's own /tmp
ROOT = Path(__file__).resolve().parent.parent
STARTED = "raoe own node started"


class OwnNode:
    """``with OwnNode(gcs_address, num_cpus=1) as node:`` a node joined to the cluster at ``gcs_address`` for the
    block, stopped (its raylet, workers and agents) after."""

    START_TIMEOUT_S = 120
    ATTEMPTS = 3

    def __init__(self, gcs_address: str, num_cpus: int = 1, keys: tuple[str, str] = ("raoe-test", "raoe-test")):
        self.gcs_address, self.num_cpus = gcs_address, num_cpus
        self.env = {
            "PATH": f"{VENV_BIN}{os.pathsep}/usr/bin:/bin", "HOME": "/tmp/home", "LANG": "C.UTF-8",
            **SAFE_LOCAL_ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "PYTHONPATH": str(ROOT),
            "AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1], "AWS_EC2_METADATA_DISABLED": "true",
            "RAOE_NODE_CACHE": NODE_CACHE, "HF_HUB_OFFLINE": "1",
            **{k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
               if k in os.environ},
        }
        self._process: subprocess.Popen | None = None
        self._said: collections.deque[str] = collections.deque(maxlen=40)

    def __enter__(self) -> OwnNode:
        """Started, or a RuntimeError with what it said. Ray gives a node's raylet 30 s to register with the GCS, which
        two busy cores can exceed (pytest's two workers, each with a Ray): a start that timed out is tried again."""
        for attempt in range(1, self.ATTEMPTS + 1):
            if self._start():
                return self
            if "timed out during startup" not in "".join(self._said) or attempt == self.ATTEMPTS:
                raise RuntimeError(f"the node in its own namespace did not start:\n{''.join(self._said)}")
            print(f"[raoe test] the node's raylet did not register in time; starting it again ({attempt})", flush=True)
        raise AssertionError("unreachable")

    def _start(self) -> bool:
        # Not `ray start --address`: with Ray's loopback switch on (SAFE_LOCAL_ENV) it refuses to join, and with it off
        # it resolves 127.0.0.1 to the machine's outward address. Ray's own Node API, as cluster_utils adds nodes.
        join = [str(VENV_BIN / "python"), "-m", "tests.own_node", self.gcs_address, str(self.num_cpus)]
        script = f"{own_tmp()} && mkdir -p /tmp/home && exec {shlex.join(join)}"
        self._said.clear()
        self._process = subprocess.Popen(["unshare", "-Urm", "sh", "-c", script], env=self.env, cwd=ROOT,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
        started = threading.Event()
        threading.Thread(target=self._listen, args=(started,), daemon=True).start()
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not started.wait(0.2):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._stop()
                time.sleep(0.5)  # the listener reads what a process that failed at once said
                return False
        return True

    def __exit__(self, *exc) -> None:
        self._stop()

    def _listen(self, started: threading.Event) -> None:
        for line in self._process.stdout:
            self._said.append(line)
            if STARTED in line:
                started.set()

    def kill(self) -> None:
        """The node lost at once (a preempted machine): every process of it killed, nothing drained."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()

    def _stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def own_tmp() -> str:
    """Shell commands giving the namespace a fresh tmpfs on /tmp, the checkout (code and venv, which a cluster's node
    has too) kept where it is when it lies under /tmp (a clone there: CI's may): the machine's /tmp is held at
    /var/tmp while the checkout is bound back, then let go."""
    if Path("/tmp") not in ROOT.parents:
        return "mount -t tmpfs none /tmp"
    held = Path("/var/tmp") / ROOT.relative_to("/tmp")
    return (f"mount --bind /tmp /var/tmp && mount -t tmpfs none /tmp && mkdir -p {shlex.quote(str(ROOT))} && "
            f"mount --bind {shlex.quote(str(held))} {shlex.quote(str(ROOT))} && umount -l /var/tmp")


def _run_node(gcs_address: str, num_cpus: int) -> None:
    """Inside the namespace: a Ray node joined to ``gcs_address`` until SIGTERM, its processes stopped then."""
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        gcs_address=gcs_address, node_ip_address="127.0.0.1", num_cpus=num_cpus, num_gpus=0,
        object_store_memory=300 << 20, min_worker_port=0, max_worker_port=0, node_manager_port=0,
        dashboard_agent_listen_port=None)
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"{STARTED}: {node.node_id} (/tmp and HOME of its own)", flush=True)
    stop.wait()
    node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    _run_node(sys.argv[1], int(sys.argv[2]))
