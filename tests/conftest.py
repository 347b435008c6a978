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


# The quick tier's multi-process smoke set: one run per capability on 2-4 gloo ranks (dense and sparse rings, flat and
# hierarchical; the estimator; packed documents; the Trainer, Fabric and a plain loop against one device). The rest of
# tests/distributed runs in the full suite.
QUICK_DISTRIBUTED = {
    "test_ring.py::test_flat_ring_matches_dense[2]",
    "test_ring.py::test_hierarchical_ring_matches_dense[4-2]",
    "test_sparse_ring.py::test_flat_sparse_ring_matches_sparse_attention[2]",
    "test_estimation.py::test_estimator_matches_float64_reference_on_every_rank[2]",
    "test_packed_documents.py::test_ring_with_documents_matches_reference[3]",
    "test_strategy.py::test_two_processes_match_single_process",
    "test_fabric.py::test_fabric_loop_two_processes_matches_single_process",
    "test_parallel.py::test_plain_loop_matches_one_device[2-2-True-True]",
}


def pytest_collection_modifyitems(config, items):
    """The tiers: ``tests/distributed`` (several processes) is ``slow`` but for :data:`QUICK_DISTRIBUTED`, as are
    single-process tests marked so (over ~15 s on 2 cores: the Triton-interpreter suites, the real model, subprocess
    checks); ``-m "not slow"`` is the quick tier. ``tests/gpu`` and tests marked ``gpu`` skip without CUDA."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        tier = item.path.parent.name
        if tier == "distributed" and f"{item.path.name}::{item.name}" not in QUICK_DISTRIBUTED:
            item.add_marker(pytest.mark.slow)
        if tier == "gpu":
            item.add_marker(pytest.mark.gpu)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The Triton-interpreter check files run in subprocesses of their own (``helpers.interpreter``): when the session
    holds other tests too, start them now, at the lowest priority, so they run beside the rest instead of after it."""
    from helpers.interpreter import start_interpreter_checks

    if session.config.option.collectonly:
        return
    paths = {str(item.path) for item in session.items if "interpreter_results" in getattr(item, "fixturenames", ())}
    if paths and any(str(item.path) not in paths for item in session.items):
        for path in sorted(paths):
            start_interpreter_checks(path, background=True)


def pytest_sessionfinish(session, exitstatus):
    from helpers.interpreter import stop_interpreter_checks

    stop_interpreter_checks()
