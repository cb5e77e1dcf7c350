"""MLflow defaults: MLFLOW_TRACKING_URI, or a sqlite store and an artifact folder in the working directory."""

from __future__ import annotations

import os
from pathlib import Path


def tracking_uri() -> str:
    """The tracking URI in force; also exported so Ray workers (runtime_env) use the same store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
        os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return uri


def artifact_root() -> Path:
    return Path(os.environ.get("RAOE_MLFLOW_ARTIFACTS", Path.cwd() / "mlartifacts")).resolve()


def ensure_experiment(name: str) -> str:
    """Create the experiment once, in the driver (concurrent creation on sqlite races), and return its id."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    existing = mlflow.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):
        location = (artifact_root() / name).as_uri()  # sqlite has no artifact root of its own: set it explicitly
    return mlflow.create_experiment(name, artifact_location=location)
