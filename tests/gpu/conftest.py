"""GPU tests: a k3-slice model is about 55 GB on the device (its 2,688 MXFP4 experts), and the
objects that hold one (engines, their CUDA graphs) can sit in reference cycles that only the
cyclic collector frees. Collect and return the memory after every module, so the next module's
model fits."""
import gc

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _free_device_memory_after_module():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
