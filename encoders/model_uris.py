"""MLflow model URIs as model sources: ``models:/raoe-s1/3``, ``models:/raoe-s1@champion``, ``runs:/<id>/model``
downloaded once into the model cache and turned back into the local sentence-transformers folder raoe exported
(its metadata, relation table and model card put back beside ``modules.json``). ``resolve_model`` is the one
resolver for every source a config may name."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from encoders.cache import building, cache_root
from encoders.model_files import MODEL_CARD, RAOE_META, RELATIONS_JSON, RELATIONS_WEIGHTS
from encoders.sources import resolve_model_source

# raoe's files beside the sentence-transformers ones (its model card replaces the one the flavor writes)
EXTRA_FILES = (RAOE_META, RELATIONS_JSON, RELATIONS_WEIGHTS, MODEL_CARD)
MODEL_URI_PREFIXES = ("models:/", "runs:/", "mlflow-artifacts:/")


def is_model_uri(source: str | None) -> bool:
    return bool(source) and source.startswith(MODEL_URI_PREFIXES)


def resolve_model(source: str) -> str:
    """Any model source raoe accepts, MLflow model URIs included, as a local folder (or an HF id)."""
    return download_model(source) if is_model_uri(source) else resolve_model_source(source)


def resolve_alias(uri: str) -> str:
    """``models:/name@alias`` -> ``models:/name/<version>`` (so a cache entry never goes stale when an alias moves)."""
    if uri.startswith("models:/") and "@" in uri:
        from mlflow import MlflowClient

        name, alias = uri.removeprefix("models:/").split("@", 1)
        version = MlflowClient().get_model_version_by_alias(name, alias)
        return f"models:/{name}/{version.version}"
    return uri


def download_model(uri: str, cache: str | Path | None = None) -> str:
    """A local sentence-transformers folder for a model URI, downloaded once per tracking store and version
    (the key includes the store and the version's creation time, so a new store's version 1 is not stale)."""
    import mlflow

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
            if found and (name == MODEL_CARD or not (modules.parent / name).exists()):
                shutil.copy(found[0], modules.parent / name)
