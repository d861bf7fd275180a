"""Registers the gpu marker for these tests even where pyproject's marker list is not loaded, and
holds the fixtures several GPU test modules share."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")


@pytest.fixture(scope="session")
def kernels_built() -> None:
    """Skips (with the reason) where the epbench kernels are not built."""
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except RuntimeError as e:
        pytest.skip(str(e))
