"""Registers the gpu marker for these tests even where pyproject's marker list is not loaded."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
