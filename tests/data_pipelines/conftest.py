import pytest


@pytest.fixture(autouse=True)
def _ray(ray_local):
    """Every data-pipeline test may read through Ray Data: on the shared local Ray (tests/conftest.py), never on one
    Ray Data would start by itself."""
