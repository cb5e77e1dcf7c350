"""Where a job's outputs live, so that nothing it registers or checkpoints is lost with a cluster.

A job submitted with ``ray job submit --working-dir .`` runs in Ray's unpacked copy of the directory
(``<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>``), which Ray deletes with the
session, garbage-collects, or replaces when the code (and so the hash) changes. Relative output paths (output_dir,
trainer.storage_path, the default MLflow store and artifacts) therefore resolve under ``RAOE_HOME`` (default
``~/raoe``) when the job runs in such a copy, and against the working directory otherwise; an absolute path inside a
copy is refused."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "RAOE_HOME"


def raoe_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / "raoe").expanduser().resolve()


def ray_package_root(path: str | Path) -> Path | None:
    """The Ray working-dir copy that ``path`` lies in, or None."""
    path = Path(path).expanduser().absolute()
    for folder in (path, *path.parents):
        if folder.name.startswith("_ray_pkg_") and folder.parent.name in ("working_dir_files", "py_modules_files"):
            return folder
    return None


def base_dir() -> Path:
    """What relative output paths are relative to: RAOE_HOME inside a Ray working-dir copy, else the cwd."""
    return raoe_home() if ray_package_root(Path.cwd()) else Path.cwd().resolve()


def stable_path(value: str) -> str:
    """An output location that outlives the job: URIs (s3://, gs://) unchanged, relative paths made absolute
    against ``base_dir()``, and an absolute path inside a Ray working-dir copy refused."""
    if "://" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_absolute():
        return str((base_dir() / path).resolve())
    package = ray_package_root(path)
    if package is not None:
        raise ValueError(f"{value!r} lies inside Ray's scratch copy of the job's working dir ({package}), which is "
                         f"deleted with the cluster; give a path outside it, or a relative one (resolved under "
                         f"{HOME_ENV}={raoe_home()})")
    return str(path.resolve())
