"""Test-wide settings: GPU tests are skipped on machines without CUDA; CPU ops run on one thread
(the test models are tiny, and intra-op threads only contend with each other on a 2-core CI
machine: one thread is several times faster there)."""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
