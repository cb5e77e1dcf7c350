"""Test-wide settings: offline hub, no telemetry, loopback-only Ray, a private model cache per session."""

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
