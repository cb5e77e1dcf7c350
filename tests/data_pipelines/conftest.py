import pytest


@pytest.fixture(scope="package")
def ray_local():
    """One local Ray for the data-pipeline tests (loopback only, shut down at the end)."""
    from runtime.local_ray import ray_session

    with ray_session(num_cpus=2):
        yield
