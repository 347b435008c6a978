"""The processes of a launcher test (``tests/distributed/test_launchers.py``): each trains a tiny Qwen2 for one step
with ``MTrainingStrategy()`` under the launcher environment it was started with, and writes what the strategy built
(world, node, cluster environment, mesh, CP group, inner and outer rings, the logged mesh line) to ``OUT/rank{R}.json``.

    python tests/helpers/launch_worker.py OUT DEVICES NUM_NODES ENVS_JSON    # start one process per environment
    python tests/helpers/launch_worker.py OUT DEVICES NUM_NODES              # be one process (the environment as it is)

With ``ENVS_JSON`` (a JSON list of environment-variable dicts) this process imports Lightning and the plugin once and
forks one child per dict, which sets those variables and runs as a launcher's process would: the imports, by far the
largest cost of a process on CPU, are paid once per test instead of once per rank. A child that fails ends the
others. Without it, the process runs as it is; Lightning's launcher runs this script again that way (``sys.argv``)
to start a machine's other processes under ``LightningEnvironment``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_rank(out_dir: str, devices: int, num_nodes: int) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    from helpers.training import lightning_module_class, make_samples
    from lightning_mtraining import MTrainingStrategy

    warnings.filterwarnings("ignore")
    # a rank that failed makes the others fail within a minute, not the default half hour
    strategy = MTrainingStrategy(block_size=4, sparsity=None, timeout=timedelta(seconds=60))
    module = lightning_module_class()("qwen2")
    loader = torch.utils.data.DataLoader(make_samples(2, 13), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)

    def ranks(group):
        return None if group is None else dist.get_process_group_ranks(group)

    plan, mesh, env = strategy.plan, strategy.device_mesh, strategy.cluster_environment
    record = {
        "rank": trainer.global_rank, "world": trainer.world_size, "node": env.node_rank(),
        "local_rank": env.local_rank(), "environment": type(env).__name__,
        "mesh": [list(mesh.mesh_dim_names), mesh.mesh.tolist()], "cp": ranks(plan.group),
        "inner": ranks(plan.inner_group), "outer": ranks(plan.outer_group), "inner_ring_size": strategy.inner_ring_size,
        "line": strategy._logged_mesh, "loss": float(trainer.callback_metrics["train_loss"]),
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def fork_processes(envs: list[dict[str, str]], rank_argv: list[str]) -> int:
    """Fork one child per environment; 0 when all of them succeeded."""
    import lightning  # noqa: F401 - imported once here, inherited by every child
    import transformers  # noqa: F401

    import helpers.training  # noqa: F401
    import lightning_mtraining  # noqa: F401

    children = []
    for env in envs:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(env)
                sys.argv = rank_argv  # what Lightning's launcher runs again for a machine's other processes
                run_rank(rank_argv[1], int(rank_argv[2]), int(rank_argv[3]))
                code = 0
            except BaseException:  # noqa: BLE001 - reported, then this child exits non-zero
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    failed = 0
    alive = set(children)
    while alive:
        pid, status = os.wait()
        if pid not in alive:
            continue
        alive.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
            for other in alive:  # the others would wait for it in a collective
                os.kill(other, signal.SIGKILL)
            time.sleep(0.1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, TESTS)
    out, devices, nodes = sys.argv[1], sys.argv[2], sys.argv[3]
    if len(sys.argv) > 4:
        with open(sys.argv[4]) as f:
            sys.exit(fork_processes(json.load(f), [os.path.abspath(__file__), out, devices, nodes]))
    run_rank(out, int(devices), int(nodes))
