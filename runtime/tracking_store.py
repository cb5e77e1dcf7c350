"""MLflow defaults: MLFLOW_TRACKING_URI, or a sqlite store in the working directory (RAOE_HOME inside Ray's scratch
copy of it); artifacts in RAOE_MLFLOW_ARTIFACTS, or next to a sqlite store's file. Nothing may point into the
scratch copy (runtime/paths.py): registered models there are lost with the cluster."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

from runtime.paths import base_dir, ray_package_root, stable_path
from tracking.metrics import check_reachable

SQLITE = "sqlite:///"


def tracking_uri() -> str:
    """The tracking URI in force (a relative sqlite file made absolute); also exported so Ray workers
    (runtime_env) use the same store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"{SQLITE}{base_dir() / 'mlflow.db'}"
    elif uri.startswith(SQLITE):  # sqlite:///x.db is relative to the cwd, sqlite:////abs/x.db absolute
        uri = SQLITE + stable_path(uri[len(SQLITE):] or "mlflow.db")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return uri


def local_store() -> dict[str, str]:
    """{"MLFLOW_TRACKING_URI": its file} where the store is a file on this machine (sqlite, a file store), with its
    artifacts beside it: Ray Train's rank 0 logs step metrics and artifacts there, so on a cluster whose workers may
    run on another machine it is a node-local path like any other (a tracking server, an http(s) URI, is not)."""
    uri = tracking_uri()
    if uri.startswith(SQLITE):
        return {"MLFLOW_TRACKING_URI": uri[len(SQLITE):]}
    if uri.startswith("file:") or "://" not in uri:
        return {"MLFLOW_TRACKING_URI": uri.removeprefix("file://").removeprefix("file:")}
    return {}


def local_location(location: str) -> str | None:
    """The folder an artifact location names on this machine, or None for a store's URI (``s3://``, a tracking
    server's proxied ``mlflow-artifacts:/1``), which no working folder holds (read as a relative path, a job under
    ``ray job submit`` found it inside its scratch copy and refused every run after the first)."""
    if location.startswith("file:"):
        return urlparse(location).path
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", location):
        return None
    return location


def artifact_root() -> str:
    """RAOE_MLFLOW_ARTIFACTS (a path, or an object-store URI such as ``s3://bucket/mlartifacts``: MLflow's S3 store
    reads the standard AWS variables and MLFLOW_S3_ENDPOINT_URL), else ``mlartifacts`` beside a sqlite store's file,
    else under ``base_dir()``."""
    configured = os.environ.get("RAOE_MLFLOW_ARTIFACTS")
    if configured:
        return stable_path(configured).rstrip("/")
    uri = tracking_uri()
    if uri.startswith(SQLITE):
        return str(Path(uri[len(SQLITE):]).parent / "mlartifacts")
    return str(base_dir() / "mlartifacts")


def ensure_experiment(name: str) -> str:
    """Create the experiment once, in the driver (concurrent creation on sqlite races), and return its id."""
    import mlflow

    check_reachable(tracking_uri())  # before any Ray resource: a clear error naming the URI
    mlflow.set_tracking_uri(tracking_uri())
    existing = mlflow.get_experiment_by_name(name)
    if existing is not None:
        location = local_location(existing.artifact_location)
        if location is not None and ray_package_root(location) is not None:
            raise ValueError(f"MLflow experiment {name!r} keeps its artifacts in Ray's scratch copy of a job's working "
                             f"dir ({existing.artifact_location}), which is deleted with the cluster: choose another "
                             f"tracking.experiment (new experiments put artifacts next to the store)")
        return existing.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):
        root = artifact_root()  # sqlite has no artifact root of its own: set it explicitly
        location = f"{root}/{name}" if "://" in root else (Path(root) / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)
