"""The dry run of a cluster config (``examples/cli.py check --config C``; ``strategies.cluster.simulate_cluster``):
every rank's Trainer and strategy built in one CPU process as torchrun starts that rank, and its mesh and rings over
a fake process group.

Compared against the layout the strategy promises (Note [Launchers and cluster environments]): a CP group is
``cp`` consecutive ranks, an inner ring is the ranks of one node, an outer ring the same local rank on each node, a
DP group the same CP rank in each CP group. A config the strategy refuses fails the check with the strategy's own
message and exit status 1; the ready-made 4 x 8 configs pass.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.scripts import ROOT


def _build(nodes: int, devices: int, **strategy_kwargs):
    def build():
        import lightning as L

        from lightning_mtraining import MTrainingStrategy

        return L.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, logger=False,
                         strategy=MTrainingStrategy(sparsity=None, **strategy_kwargs)).strategy
    return build


def test_two_nodes_of_two_build_a_hierarchical_ring_inside_each_node():
    import torch.distributed as dist

    from lightning_mtraining.strategies.cluster import describe_simulation, simulate_cluster

    ranks = simulate_cluster(_build(2, 2, context_parallel_size=4), nodes=2, devices=2)
    assert not dist.is_initialized()  # nothing left behind
    assert [(r.rank, r.node, r.local_rank) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for r in ranks:
        assert r.groups == {"dp": (r.rank,), "cp": (0, 1, 2, 3)}
        assert r.inner == tuple(range(r.node * 2, r.node * 2 + 2))  # the ranks of its node
        assert r.outer == (r.local_rank, 2 + r.local_rank)  # its local rank on each node
    lines = describe_simulation(ranks, devices=2)
    assert lines[0] == ("MTrainingStrategy: world 4 (2 nodes x 2) = dp 1 x cp 4, hierarchical ring: 2 outer (across "
                        "nodes) x 2 inner (within a node), striped layout (block 128)")
    assert lines[-1] == "every inner ring lies inside one node: only the outer rings cross nodes"


def test_cp_inside_nodes_and_dp_across_them():
    from lightning_mtraining.strategies.cluster import describe_simulation, simulate_cluster

    ranks = simulate_cluster(_build(2, 4, context_parallel_size=4), nodes=2, devices=4)
    for r in ranks:
        base = r.node * 4
        assert r.groups == {"dp": (r.rank % 4, 4 + r.rank % 4), "cp": tuple(range(base, base + 4))}
        assert r.inner is None and r.outer is None
    assert describe_simulation(ranks, 4)[-1] == "every context-parallel group lies inside one node: its ring never " \
                                               "crosses nodes"


def test_a_rank_the_strategy_refuses_fails_the_simulation_with_its_message():
    from lightning_mtraining.strategies.cluster import simulate_cluster

    with pytest.raises(ValueError, match="context_parallel_size=3 does not divide the world size 4"):
        simulate_cluster(_build(2, 2, context_parallel_size=3), nodes=2, devices=2)


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/cli.py", "check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_the_cli_checks_the_ready_made_2m_config_and_refuses_a_bad_one():
    run = _check("--config", "examples/configs/cluster_4x8_2m.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert ("MTrainingStrategy: world 32 (4 nodes x 8) = dp 1 x cp 32, hierarchical ring: 4 outer (across nodes) x 8 "
            "inner (within a node), striped layout (block 128)") in out, out
    assert out.count("  rank ") == 32 and "  rank 9 (node 1, local rank 1): dp [9]; cp [0..31]; inner ring [8..15], " \
                                          "outer ring [1, 9, 17, 25]" in out, out
    assert "model: Qwen2ForCausalLM (36 layers, 16 query / 2 KV heads)" in out and out.rstrip().endswith("check passed")
    bad = _check("--config", "examples/configs/cluster_4x8_2m.yaml",
                 "--trainer.strategy.init_args.inner_ring_size", "3")
    assert bad.returncode == 1 and "check passed" not in bad.stdout
    want = "check failed: ValueError: inner_ring_size=3 does not divide context_parallel_size=32"
    assert want in bad.stderr, bad.stderr


@pytest.mark.slow  # two dry runs of 4 x 8 worlds (~15 s each on 2 cores)
def test_the_check_output_docs_cluster_shows_is_what_the_checks_print():
    """Every line ``docs/cluster.md`` quotes after a ``cli.py check`` command is a line that command prints (the
    512K plan's config is the ready-made ``cluster_4x8_512k.yaml``, which the plan command writes unchanged)."""
    doc = (ROOT / "docs" / "cluster.md").read_text()
    block = doc.split("python examples/cli.py check --config plan.yaml", 1)[1].split("```", 1)[0]
    runs, config = {}, "examples/configs/cluster_4x8_512k.yaml"
    for line in block.splitlines():
        if line.startswith("python examples/cli.py check --config "):
            config = line.split("--config ", 1)[1].split()[0]
        elif line.startswith("#   "):
            runs.setdefault(config, []).append(line[4:].rstrip())
    assert set(runs) == {"examples/configs/cluster_4x8_512k.yaml", "examples/configs/cluster_4x8_2m.yaml"}, runs
    for config, quoted in runs.items():
        run = _check("--config", config)
        assert run.returncode == 0, run.stderr[-3000:]
        printed = run.stdout.splitlines()
        for line in quoted:
            assert line in printed, (config, line)
