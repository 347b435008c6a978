import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _reset_torch_state():
    """Each test starts from the same seed and default dtype, and leaves them as it found them."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _isolate_in_process_trainers():
    """An in-process Trainer initialises a (world size 1) process group and sets MASTER_ADDR/PORT etc.; undo
    both so later tests (and the subprocesses they start, which would inherit MASTER_PORT and find the port still
    held by this process's store) begin from a clean process."""
    import torch.distributed as dist

    env = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
