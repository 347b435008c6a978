"""Each launcher's world, as the strategy builds it: Lightning Studio multi-machine jobs, torchrun and SLURM's srun.

Every test starts the processes of a 2-node x 2-process "cluster" on this machine with the environment variables
that launcher sets (nothing else: the strategy must find the world through Lightning's cluster environments), trains
one step with ``MTrainingStrategy()`` (CP over all 4 ranks, ``inner_ring_size=None``) and checks what every rank
built: the world, its node, the cluster environment Lightning detected, the ``("dp", "cp")`` mesh, the CP group, the
inner ring (= the ranks of its own node) and the outer ring (the same local rank on each node), and rank 0's mesh
line. ``tests/helpers/launch_worker.py`` is the script each process runs (it imports once and forks the processes with
their launcher's variables; Lightning's launcher starts processes as a fresh ``python`` running that script).

- Studio: the platform runs the command once per machine with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
  Lightning (``LightningEnvironment``) starts the machine's second process itself.
- torchrun: every process gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...); ``TorchElasticEnvironment``.
  (``tests/distributed/test_multinode.py`` runs real torchrun agents.)
- SLURM: every process gets srun's variables (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``, ``SLURM_JOB_ID``, ``SLURM_NODELIST``);
  ``SLURMEnvironment`` takes the main address from the node list and the port from the job id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import clean_env, free_port

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKER = TESTS / "helpers" / "launch_worker.py"
NODES, PER_NODE = 2, 2
HIER_LINE = ("MTrainingStrategy: world 4 (2 nodes x 2) = dp 1 x cp 4, hierarchical ring: 2 outer (across nodes) x 2 "
             "inner (within a node), striped layout (block 4)")

def run_processes(tmp_path: Path, envs: list[dict[str, str]], timeout: float = 240) -> str:
    """Start one process per environment (forked by ``helpers/launch_worker.py`` after its imports), wait for all of
    them; returns their output."""
    envs_file = tmp_path / "envs.json"
    envs_file.write_text(json.dumps(envs))
    argv = [sys.executable, str(WORKER), str(tmp_path), str(PER_NODE), str(NODES), str(envs_file)]
    proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's children too
            proc.communicate()
    assert proc.returncode == 0, out[-5000:]
    return out


def check_world(out_dir: Path, output: str, environment: str) -> None:
    """The 2 x 2 world with one CP group over both nodes: hierarchical ring, inner ring = a node's two ranks."""
    world = NODES * PER_NODE
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    for r, rec in enumerate(records):
        assert rec["rank"] == r and rec["world"] == world and rec["environment"] == environment
        assert rec["node"] == r // PER_NODE and rec["local_rank"] == r % PER_NODE
        assert rec["mesh"] == [["dp", "cp"], [[0, 1, 2, 3]]]
        assert rec["cp"] == [0, 1, 2, 3] and rec["inner_ring_size"] == PER_NODE
        node = r // PER_NODE
        assert rec["inner"] == [node * PER_NODE + i for i in range(PER_NODE)]  # the ranks of this rank's node
        assert rec["outer"] == [n * PER_NODE + r % PER_NODE for n in range(NODES)]  # this local rank on each node
        assert rec["line"] == HIER_LINE
    # one CP group: every rank shows the same loss (the whole sequence's)
    assert len({rec["loss"] for rec in records}) == 1
    assert output.count(HIER_LINE) == 1  # logged once, by rank 0


def test_studio_multi_machine_job(tmp_path):
    """Studio runs ``python SCRIPT`` once per machine; Lightning starts the machine's other process."""
    port = free_port()
    # Whatever a platform puts in WORLD_SIZE (some put the number of machines) Lightning's launcher overwrites.
    machines = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(n), WORLD_SIZE=str(NODES))
                for n in range(NODES)]
    check_world(tmp_path, run_processes(tmp_path, machines), "LightningEnvironment")


def test_torchrun(tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr ... SCRIPT`` on each node."""
    port, world = free_port(), NODES * PER_NODE
    envs = [dict(RANK=str(r), LOCAL_RANK=str(r % PER_NODE), GROUP_RANK=str(r // PER_NODE), ROLE_RANK=str(r),
                 ROLE_NAME="default", LOCAL_WORLD_SIZE=str(PER_NODE), WORLD_SIZE=str(world),
                 GROUP_WORLD_SIZE=str(NODES), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="launch-test", TORCHELASTIC_RESTART_COUNT="0",
                 TORCHELASTIC_MAX_RESTARTS="0")
            for r in range(world)]
    check_world(tmp_path, run_processes(tmp_path, envs), "TorchElasticEnvironment")


def test_slurm_srun(tmp_path):
    """``srun`` in an allocation of 2 nodes with ``--ntasks-per-node 2``: every task is started by SLURM."""
    port, world = free_port(15000, 25000), NODES * PER_NODE
    job_id = f"7{port - 15000:04d}"  # SLURMEnvironment's port: the job id's last 4 digits + 15000
    envs = [dict(SLURM_PROCID=str(r), SLURM_LOCALID=str(r % PER_NODE), SLURM_NODEID=str(r // PER_NODE),
                 SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(PER_NODE), SLURM_NNODES=str(NODES),
                 SLURM_JOB_NUM_NODES=str(NODES), SLURM_JOB_ID=job_id, SLURM_JOB_NAME="mtraining",
                 SLURM_NODELIST="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1")
            for r in range(world)]
    check_world(tmp_path, run_processes(tmp_path, envs), "SLURMEnvironment")


def test_node_layout_is_checked(monkeypatch):
    """torchrun with 2 processes on each of 2 nodes, but ``Trainer(devices=4, num_nodes=1)``: Lightning's own check
    (devices x num_nodes = WORLD_SIZE) passes, the strategy's does not, before any collective."""
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from lightning_mtraining import MTrainingStrategy

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for k, v in dict(RANK="2", LOCAL_RANK="0", GROUP_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    strategy = MTrainingStrategy(cluster_environment=TorchElasticEnvironment(),
                                 parallel_devices=[torch.device("cpu")] * 4)
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.world_size, strategy.num_nodes) == (2, 4, 1)
    with pytest.raises(ValueError, match=r"global rank 2 runs on node 1 \(TorchElasticEnvironment\), but with "
                                         r"devices=4 and num_nodes=1 the strategy takes node 0 to hold ranks 0..3"):
        strategy._check_node_layout()
    strategy.num_nodes = 2  # as a matching Trainer(devices=2, num_nodes=2) would set it
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy._check_node_layout()  # rank 2 = node 1's first process: consistent


_WRONG_DEVICES = """
import lightning as L
from lightning_mtraining import MTrainingStrategy

L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=MTrainingStrategy(sparsity=None), logger=False)
print("the Trainer was built")
"""


def test_devices_below_torchruns_processes_fail_before_any_work(tmp_path):
    """A real ``torchrun --nproc-per-node 2`` on one machine under ``Trainer(devices=1, num_nodes=2)``: both ranks
    stop at ``Trainer(...)`` with the fix, said once by rank 0 and in one line by rank 1 (without the check: a bare
    ``IndexError`` from Lightning once a process group exists). ``tests/unit/test_node_layout.py`` has both
    directions."""
    script = tmp_path / "wrong_devices.py"
    script.write_text(_WRONG_DEVICES)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(script)], env=clean_env(), capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "the Trainer was built" not in text, text
    assert "IndexError" not in text, text
    assert text.count("[rank0]: ValueError: MTrainingStrategy: the launcher (TorchElasticEnvironment) started 2 "
                      "processes on each node over 1 node") == 1, text
    assert text.count("Use devices=2 and num_nodes=1") == 1, text
    assert [line for line in text.splitlines() if line.startswith("[rank1]:")] == [
        next(line for line in text.splitlines() if line.startswith("[rank1]: ValueError, reported by rank 0"))], text


def test_mesh_line_says_where_rings_run():
    """The default inner ring on ``num_nodes > 1`` and what rank 0's line says, for CP groups inside a node, over
    whole nodes, over part of nodes, and an explicit inner ring that straddles nodes."""
    from lightning_mtraining.distributed.mesh import describe_mesh, resolve_inner_ring_size

    def line(world, cp, per_node, inner=None):
        inner = resolve_inner_ring_size(inner, cp, per_node)
        return inner, describe_mesh("S", world, cp, inner, "striped", 128, num_nodes=world // per_node)

    assert line(32, 32, 8) == (8, "S: world 32 (4 nodes x 8) = dp 1 x cp 32, hierarchical ring: 4 outer (across "
                                  "nodes) x 8 inner (within a node), striped layout (block 128)")
    assert line(32, 8, 8)[1].endswith("dp 4 x cp 8, flat ring of 8 within a node, striped layout (block 128)")
    assert line(8, 4, 2)[1].endswith("hierarchical ring: 2 outer (across nodes) x 2 inner (within a node), "
                                     "striped layout (block 128)")
    # CP 6 on nodes of 4: groups cross a node boundary part-way; inner rings of gcd(6, 4) = 2 stay in a node
    assert line(12, 6, 4) == (2, "S: world 12 (3 nodes x 4) = dp 2 x cp 6, hierarchical ring: 3 outer (across "
                                 "nodes) x 2 inner (within a node), striped layout (block 128)")
    # no inner ring fits a node (gcd 1): flat, and the line says every step waits on the inter-node link
    assert line(6, 3, 2)[1].endswith("flat ring of 3 across nodes (every ring step waits on the inter-node link), "
                                     "striped layout (block 128)")
    assert line(16, 16, 4, inner=8)[1].endswith("hierarchical ring: 2 outer x 8 inner (an inner ring spans 2 nodes), "
                                                "striped layout (block 128)")
    assert line(8, 4, 4, inner=2)[1].endswith("hierarchical ring: 2 outer x 2 inner (all within a node), striped "
                                              "layout (block 128)")
    # one node: the line as before
    assert describe_mesh("S", 8, 4, 4, "zigzag", 128) == "S: world 8 = dp 2 x cp 4, flat ring of 4, zigzag layout"
