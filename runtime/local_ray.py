"""Connect to the cluster in RAY_ADDRESS, or start an embedded local Ray bound to 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from storage.paths import STORAGE_ENV, is_uri

# DESIGN.md, measured here: this makes every Ray listener bind to loopback; it also turns on token
# auth, which local runs switch off (a stale ~/.ray/auth_token otherwise kills actors).
SAFE_LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "TOKENIZERS_PARALLELISM": "false",
}

# Variables that workers need too: the driver's environment does not reach a running cluster's workers. Not
# RAOE_NODE_CACHE: each node keeps its copies where its own environment says (its own disk), never at the driver's path.
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY", "HF_HUB_OFFLINE", "HF_HOME", "RAOE_CACHE",
    "RAOE_NODE_CACHE_MAX_GB", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_PARALLELISM", "RAOE_DEV_DATA", *STORAGE_ENV,
)

# A local Ray started by a job is one node that lives and dies with the job: Ray Train's preemption watcher (an actor
# per run that waits for a cloud node's drain notice) has nothing to watch there.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# RAOE_RAY_DASHBOARD=0: a local Ray without Ray's dashboard (about 2.5 s less to start, and its polling processes); the
# test suite uses it. Nothing raoe runs on a local Ray needs the dashboard; it is on by default for people to look at.
DASHBOARD_ENV = "RAOE_RAY_DASHBOARD"
# Ray keeps one idle task worker per CPU and kills the others after 1 s idle, but Ray Data runs more tasks at once than
# there are CPUs (fractional CPUs, several operators): on a local Ray the next Ray Data operator then starts fresh
# Pythons that import pyarrow and pandas again (1-2.5 s each here; a 128-row groupby, sort and shuffle took 19 s, and
# 0.4 s with warm workers). A local Ray (and the demo's local head) keeps idle workers for 10 minutes instead.
LOCAL_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 600_000}
_local: dict[str, str | None] = {"started": None}  # the GCS address of the local Ray this process started

# Never upload these with `ray job submit --working-dir .`.
WORKING_DIR_EXCLUDES = [".venv", ".git", "mlruns", "mlartifacts", "mlflow.db", "raoe_runs", "outputs", ".cache",
                        "**/__pycache__", ".pytest_cache", ".ruff_cache", "benchmarks/results/*.png"]


def apply_safe_local_env() -> None:
    """Set the loopback-only environment for a local Ray. Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when
    it is imported, so a process that imported ray earlier also gets the constant itself switched off."""
    if os.environ.get("RAY_ADDRESS"):
        return
    for key, value in SAFE_LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    if "ray" in sys.modules and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def worker_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    # Workers import the project's packages from the driver's checkout (local runs) or the uploaded working dir.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(project_root()), os.environ.get("PYTHONPATH", "")]))
    return env


def start_ray(num_cpus: int | None = None) -> bool:
    """Start or join Ray. Returns True when this call started a local Ray that the caller must shut down."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": worker_env()}
    if os.environ.get("RAY_ADDRESS"):
        # Under `ray job submit` the job already has a runtime env (working_dir, env_vars); ours adds to it.
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return False
    apply_safe_local_env()
    for key, value in LOCAL_TRAIN_ENV.items():  # read by Ray Train's controller, which gets the driver's value
        os.environ.setdefault(key, value)
    ray.init(
        address="local",  # a new Ray here, never a `ray start` head this machine may run (Ray's default joins it)
        num_cpus=num_cpus,
        include_dashboard=os.environ.get(DASHBOARD_ENV, "1") != "0",
        dashboard_host="127.0.0.1",  # loopback only, like every other listener
        _node_ip_address="127.0.0.1",
        runtime_env=runtime_env,
        configure_logging=True,
        logging_level="WARNING",
        _system_config=LOCAL_SYSTEM_CONFIG,
    )
    size_shuffles_to_this_machine(num_cpus or os.cpu_count() or 1)
    _local["started"] = _gcs_address()
    return True


def runs_local_ray() -> bool:
    """True while this process runs the local Ray it started (not a cluster it joined, nor one that started it)."""
    import ray

    return ray.is_initialized() and _local["started"] == _gcs_address()  # not a Ray joined since one was shut down


def _gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def size_shuffles_to_this_machine(cpus: int) -> None:
    """Ray Data hash-shuffles (groupby, distinct texts) into 200 partitions by default, sized for a cluster: on one
    machine that is hundreds of tiny tasks for a few thousand rows. A local Ray uses two per CPU; a cluster keeps
    Ray's default."""
    import ray.data

    ray.data.DataContext.get_current().default_hash_shuffle_parallelism = max(2, min(200, 2 * int(cpus)))


@contextlib.contextmanager
def ray_session(num_cpus: int | None = None, outputs: dict[str, str] | None = None,
                shared_filesystem: bool = False, inputs: dict[str, str] | None = None) -> Iterator[None]:
    """Ray for the length of a job; a local Ray started here is shut down at the end. ``outputs`` / ``inputs``: the
    job's keys and paths that Ray's tasks write / read, refused where the tasks may run on another machine and the
    paths are node-local (refuse_node_local_paths)."""
    import ray

    started = start_ray(num_cpus)
    try:
        refuse_node_local_paths(outputs or {}, inputs or {}, shared_filesystem)
        yield
    finally:
        if started:
            ray.shutdown()
            _local["started"] = None


def refuse_node_local_paths(outputs: dict[str, str], inputs: dict[str, str], shared_filesystem: bool) -> None:
    """A plain local path is a different folder on every machine: tasks on another node would write their part of an
    output there (Parquet of the corpus cache, annotated sets, checkpoints) and the driver would read or register only
    its own node's, or would not find an input at all. Refused before any work, naming the keys, wherever tasks may
    run on another machine (``other_machines``), unless the config says every node mounts those paths at the same
    place (``shared_filesystem``). Hub sources (``hf:``) are not paths."""
    named = {**outputs, **inputs}
    local = {key: path for key, path in named.items() if path and not is_uri(path) and not str(path).startswith("hf:")}
    if not local or shared_filesystem:
        return
    where = other_machines()
    if where:
        listed = ", ".join(f"{key}={path}" for key, path in local.items())
        raise ValueError(f"{listed}: a local path on {where}, so each node would see only its own folder. Put it on "
                         f"storage every node reaches: an object-store URI (s3://bucket/prefix) or a file system "
                         f"mounted at the same path on every node (NFS, EFS; then set shared_filesystem=true)")


def other_machines() -> str | None:
    """Why this job's tasks may run on another machine, or None where they cannot: a local Ray this process started,
    or a cluster joined through RAY_ADDRESS that is one node bound to loopback (a `ray start --head` on this machine,
    cluster/local.yaml: no other machine can join it) with CPUs of its own. A cluster of several nodes, a head that
    runs no tasks (CPU: 0, as cluster/*.yaml and KubeRay start it: its work goes to nodes an autoscaler adds later,
    perhaps after this check) or one other machines can join (an autoscaler may add nodes at any time) may."""
    import ray

    if runs_local_ray():
        return None
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) > 1:
        return f"a cluster of {len(nodes)} nodes"
    node = nodes[0]
    if not node.get("Resources", {}).get("CPU"):
        return (f"a cluster whose one node ({node.get('NodeManagerAddress')}) runs no tasks (CPU: 0): they run on the "
                f"nodes an autoscaler adds")
    address = node.get("NodeManagerAddress", "")
    if not address.startswith("127.") and address != "::1":
        return f"a cluster at {address}, which other machines can join (an autoscaler may add nodes at any time)"
    return None


apply_safe_local_env()  # before anything imports ray, where this module is imported first
