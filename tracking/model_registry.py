"""MLflow runs and the model registry: one run per job (found again by name so a resubmitted job resumes it),
models logged with the sentence_transformers flavor (raoe's files among its extra files) and registered as raoe-s1,
raoe-s2, ... A model URI is turned back into a local folder by ``encoders.model_uris``, like every model source."""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path
from typing import Any

from encoders.model_uris import EXTRA_FILES
from storage.paths import local_copy

MODEL_ARTIFACT = "model"
REGISTERED = {"stage1": "raoe-s1", "stage2": "raoe-s2", "unsupervised": "raoe-unsup", "posttrain": "raoe-lists",
              "relational": "raoe-rse"}


def run_for_name(experiment_id: str, run_name: str | None, tags: dict[str, str] | None = None):
    """(run_id, resumed): the existing run of that name in the experiment, or a new one."""
    from mlflow import MlflowClient

    client = MlflowClient()
    if run_name:
        found = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            client.update_run(found[0].info.run_id, status="RUNNING")
            return found[0].info.run_id, True
    run = client.create_run(experiment_id, run_name=run_name, tags=tags or {})
    return run.info.run_id, False


def _pins() -> list[str]:
    names = ("sentence-transformers", "transformers", "torch")
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def log_and_register(model_dir: str | Path, run_id: str, registered_model: str | None,
                     tags: dict[str, Any] | None = None) -> dict[str, Any]:
    """Log the exported model (a local folder or one on object storage) on ``run_id`` and register it; returns
    model_uri, registered_model, version."""
    with local_copy(model_dir) as folder:
        return _log_and_register(folder, run_id, registered_model, tags)


def _log_and_register(model_dir: Path, run_id: str, registered_model: str | None, tags: dict[str, Any] | None):
    import mlflow
    from mlflow import MlflowClient
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        context = _same(active)
    else:  # e.g. a sweep's parent run is active while its best child's model is logged
        context = mlflow.start_run(run_id=run_id, nested=active is not None)
    with context:
        info = mlflow.sentence_transformers.log_model(
            model, name=MODEL_ARTIFACT, pip_requirements=_pins(),
            extra_files=[str(Path(model_dir) / f) for f in EXTRA_FILES if (Path(model_dir) / f).exists()] or None,
        )
    result: dict[str, Any] = {"model_uri": f"runs:/{run_id}/{MODEL_ARTIFACT}", "logged_model_uri": info.model_uri,
                              "registered_model": None, "version": None}
    if registered_model:
        version = mlflow.register_model(info.model_uri, registered_model, tags={k: str(v) for k, v in (tags or {}).items()})
        client = MlflowClient()
        client.set_model_version_tag(registered_model, version.version, "run_id", run_id)
        result.update(registered_model=registered_model, version=int(version.version),
                      model_uri=f"models:/{registered_model}/{version.version}")
    return result


@contextlib.contextmanager
def _same(run):
    yield run
