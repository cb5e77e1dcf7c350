import pytest


@pytest.fixture(scope="package")
def ray_local():
    """One local Ray for the data-pipeline tests (loopback only, shut down at the end)."""
    from tests.conftest import own_ray

    with own_ray(num_cpus=2):
        yield
