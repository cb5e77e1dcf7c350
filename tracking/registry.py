"""MLflow runs and the model registry: one run per job (found again by name so a resubmitted job resumes it),
models logged with the sentence_transformers flavor and registered as raoe-s1 / raoe-s2, and model URIs
(``models:/raoe-s1/3``, ``models:/raoe-s1@champion``, ``runs:/<id>/model``) turned back into local folders."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import shutil
from pathlib import Path
from typing import Any

from encoders.backbone import RAOE_META
from encoders.relational import RELATIONS_JSON, RELATIONS_WEIGHTS
from tracking.model_card import CARD

# raoe's files beside the sentence-transformers ones (its model card replaces the one the flavor writes)
EXTRA_FILES = (RAOE_META, RELATIONS_JSON, RELATIONS_WEIGHTS, CARD)

MODEL_ARTIFACT = "model"
REGISTERED = {"stage1": "raoe-s1", "stage2": "raoe-s2", "unsupervised": "raoe-unsup", "posttrain": "raoe-lists",
              "relational": "raoe-rse"}
MODEL_URI_PREFIXES = ("models:/", "runs:/", "mlflow-artifacts:/")


def is_model_uri(source: str | None) -> bool:
    return bool(source) and source.startswith(MODEL_URI_PREFIXES)


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
    """Log the exported model on ``run_id`` and register it; returns model_uri, registered_model, version."""
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


def download_model(uri: str, cache: str | Path | None = None) -> str:
    """A local sentence-transformers folder for a model URI, downloaded once per tracking store and version
    (the key includes the store and the version's creation time, so a new store's version 1 is not stale)."""
    import mlflow

    from encoders.sources import building, cache_root

    resolved, stamp = resolve_alias(uri), ""
    if resolved.startswith("models:/"):
        from mlflow import MlflowClient

        name, version = resolved.removeprefix("models:/").split("/", 1)
        stamp = str(MlflowClient().get_model_version(name, version).creation_timestamp)
    key = hashlib.sha1(f"{mlflow.get_tracking_uri()}|{resolved}|{stamp}".encode()).hexdigest()[:16]
    target = Path(cache or cache_root() / "mlflow-models") / key
    if not (target / ".complete").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with building(target) as staging:
            mlflow.artifacts.download_artifacts(artifact_uri=resolved, dst_path=str(staging))
            _restore_extra_files(staging)
    found = sorted(p.parent for p in target.rglob("modules.json"))
    if not found:
        raise FileNotFoundError(f"{uri} holds no sentence-transformers model (no modules.json)")
    return str(found[0])


def _restore_extra_files(folder: Path) -> None:
    """The flavor stores raoe's files (metadata with the prompt template, an RSE relation table) among its extra
    files: put them back next to modules.json, where load_encoder and RelationalEncoder read them."""
    for name in EXTRA_FILES:
        found = [p for p in folder.rglob(name) if not (p.parent / "modules.json").exists()]  # the extra files copy
        for modules in folder.rglob("modules.json"):
            if found and (name == CARD or not (modules.parent / name).exists()):
                shutil.copy(found[0], modules.parent / name)


def resolve_model(source: str) -> str:
    """Any model source raoe accepts, MLflow model URIs included, as a local folder (or an HF id)."""
    from encoders.sources import resolve_model_source

    return download_model(source) if is_model_uri(source) else resolve_model_source(source)


def resolve_alias(uri: str) -> str:
    """``models:/name@alias`` -> ``models:/name/<version>`` (so a cache entry never goes stale when an alias moves)."""
    if uri.startswith("models:/") and "@" in uri:
        from mlflow import MlflowClient

        name, alias = uri.removeprefix("models:/").split("@", 1)
        version = MlflowClient().get_model_version_by_alias(name, alias)
        return f"models:/{name}/{version.version}"
    return uri
