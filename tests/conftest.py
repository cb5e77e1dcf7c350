"""Test-wide settings: offline hub, no telemetry, loopback-only Ray, a private model cache per session."""

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
DEV_DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture
def dev_data() -> Path:
    """../shared/data (or RAOE_DEV_DATA); tests that need it skip with a reason on a fresh clone without it."""
    if not DEV_DATA.exists():
        pytest.skip(f"development data not found at {DEV_DATA} (set RAOE_DEV_DATA)")
    return DEV_DATA


@contextlib.contextmanager
def own_ray(num_cpus: int = 2):
    """A local Ray started here, with this moment's environment. "package"-scoped fixtures in folders without
    __init__.py live until the session ends, so another folder's Ray (and its workers' MLFLOW_TRACKING_URI)
    may still be up: shut it down rather than join it."""
    import ray

    from runtime.local_ray import ray_session

    if ray.is_initialized():
        ray.shutdown()
    with ray_session(num_cpus=num_cpus):
        yield
