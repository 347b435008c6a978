"""Two "nodes" of 2 processes each on localhost, started by two torchrun invocations (node ranks 0 and 1).

Lightning picks up torchrun's environment (TorchElasticEnvironment) exactly as on a real cluster; the test
checks the device mesh, the hierarchical rings (inner = one node's ranks, outer = the same local rank on each
node) and that the losses and parameters equal single-process training (tolerances as in test_strategy.py).

Run by hand (what the test does):

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29611 \
        tests/distributed/test_multinode.py OUT_DIR &
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29611 \
        tests/distributed/test_multinode.py OUT_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# Scenario 1: one CP group over both nodes -> hierarchical ring (inner 2 x outer 2).
# Scenario 2: CP inside each node, DP across nodes -> flat rings, DP groups disjoint.
SCENARIOS = [
    dict(family="qwen2", n_samples=6, seq_len=27, steps=2, strategy=dict(context_parallel_size=4, block_size=4)),
    dict(family="llama", n_samples=8, seq_len=13, steps=2, strategy=dict(context_parallel_size=2, block_size=4)),
]


def _node_main(out_dir: str) -> None:
    """One rank under torchrun: fit every scenario, save what the test checks."""
    import torch.distributed as dist

    from helpers.training import fit

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for scenario in SCENARIOS:
        import lightning_mtraining.strategies.common as strategy_mod  # where the strategies build their mesh

        captured = {}
        original = strategy_mod.build_context_parallel

        def spy(*args, **kwargs):
            mesh, plan = original(*args, **kwargs)
            captured["inner"] = dist.get_process_group_ranks(plan.inner_group) if plan.inner_group else None
            captured["outer"] = dist.get_process_group_ranks(plan.outer_group) if plan.outer_group else None
            captured["cp"] = dist.get_process_group_ranks(plan.group)
            return mesh, plan

        strategy_mod.build_context_parallel = spy
        try:
            result = fit(world, scenario, devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2)
        finally:
            strategy_mod.build_context_parallel = original
        result.update(captured, rank=int(os.environ["RANK"]), node=int(os.environ["GROUP_RANK"]))
        results.append(result)
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


def test_two_nodes_of_two_processes(tmp_path):
    from helpers.dist import free_port
    from helpers.training import check_against_reference

    port = free_port()
    launcher_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(HERE / "test_multinode.py"), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]

    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    hier = [per_rank[r][0] for r in range(4)]
    for r, res in enumerate(hier):
        assert res["node"] == r // 2
        assert res["mesh"] == (("dp", "cp"), [[0, 1, 2, 3]])
        assert res["cp"] == [0, 1, 2, 3]
        assert res["inner"] == [2 * (r // 2), 2 * (r // 2) + 1]  # this node's ranks
        assert res["outer"] == [r % 2, r % 2 + 2]  # same local rank on each node
    check_against_reference(hier, SCENARIOS[0])

    flat = [per_rank[r][1] for r in range(4)]
    for r, res in enumerate(flat):
        assert res["mesh"] == (("dp", "cp"), [[0, 1], [2, 3]])
        assert res["cp"] == [2 * (r // 2), 2 * (r // 2) + 1] and res["inner"] is None and res["outer"] is None
        assert res["dp_rank"] == r // 2
    check_against_reference(flat, SCENARIOS[1])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    _node_main(sys.argv[1])
