"""The model cache: where resolved, unpacked and downloaded models live, and how a model is built into it so that
concurrent workers never see half a model. The leaf of ``encoders``: model sources, tiny models and MLflow model
URIs all build into it."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path


class ModelSourceError(RuntimeError):
    """A model source that cannot be resolved; the message says what to install or fix."""


def cache_root() -> Path:
    """Where unpacked/converted models live (``RAOE_CACHE``, default ~/.cache/raoe)."""
    return Path(os.environ.get("RAOE_CACHE", Path.home() / ".cache" / "raoe"))


@contextmanager
def building(target: Path):
    """Build into a private folder and move it into place at the end, so concurrent workers never see
    a half-written model; yields the folder to write into (a finished ``target`` wins). The staging name is unique
    to this builder: on storage shared by several nodes two builders may have the same process id."""
    staging = target.parent / f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:  # a failed build leaves nothing behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / ".complete").touch()
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)


def save_weights(model, folder: Path) -> None:
    """``model.save_pretrained(folder)`` on whichever process calls it. transformers 5 writes nothing on a rank other
    than 0 of an initialised torch.distributed group (``should_save_on_this_rank``), and a model cache is built by
    whichever worker gets there first: a rank-1 build left a cached model without its config and weights."""
    model.should_save_on_this_rank = lambda is_main_process=True: True
    model.save_pretrained(folder)
    if not (Path(folder) / "config.json").exists():
        raise ModelSourceError(f"saving {type(model).__name__} to {folder} wrote no config.json")

