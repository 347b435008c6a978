"""The launcher's world against ``devices`` and ``num_nodes``, checked at ``Trainer(...)`` / ``Fabric(...)`` before any
process group exists, in both directions (Note [Launchers and cluster environments] in
``lightning_mtraining.strategies.node_layout``).

Each case sets the variables torchrun gives one of its processes (this process plays that rank) and builds the
Trainer or Fabric the user wrote: ``devices=1, num_nodes=2`` under ``torchrun --nproc-per-node 2`` on one machine
(which Lightning's own world check lets through and then ends in a bare ``IndexError``), and the converse,
``devices=2, num_nodes=1`` under ``torchrun --nnodes 2 --nproc-per-node 1``. A consistent layout builds.
``tests/distributed/test_launchers.py`` runs the first under a real torchrun.
"""

from __future__ import annotations

import pytest

ONE_NODE_TWO_PROCESSES = dict(RANK="1", LOCAL_RANK="1", GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                              GROUP_WORLD_SIZE="1")
TWO_NODES_ONE_PROCESS = dict(RANK="1", LOCAL_RANK="0", GROUP_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                             GROUP_WORLD_SIZE="2")


def _torchrun(monkeypatch, variables: dict[str, str]) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "node-layout-test")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def _without_counts(variables: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in variables.items() if k not in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")}


def _trainer(strategy_cls, devices: int, num_nodes: int):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy_cls(sparsity=None),
                     logger=False, enable_checkpointing=False)


def _fabric(devices: int, num_nodes: int):
    import lightning as L

    from lightning_mtraining import MTrainingFabricStrategy

    return L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes,
                    strategy=MTrainingFabricStrategy(sparsity=None))


def _strategies():
    from lightning_mtraining import MTrainingFSDPStrategy, MTrainingStrategy

    return [MTrainingStrategy, MTrainingFSDPStrategy]


@pytest.mark.parametrize("variables, devices, num_nodes, want", [
    (ONE_NODE_TWO_PROCESSES, 1, 2, "Use devices=2 and num_nodes=1"),
    (TWO_NODES_ONE_PROCESS, 2, 1, "Use devices=1 and num_nodes=2"),
], ids=["devices-below-the-launchers", "devices-above-the-launchers"])
@pytest.mark.parametrize("which", ["trainer", "fsdp", "fabric"])
def test_a_launcher_world_that_devices_and_num_nodes_do_not_describe_fails_at_construction(
        monkeypatch, variables, devices, num_nodes, want, which):
    from lightning_mtraining.core.errors import format_failure

    _torchrun(monkeypatch, variables)
    with pytest.raises(ValueError) as info:
        if which == "fabric":
            _fabric(devices, num_nodes)
        else:
            _trainer(_strategies()[which == "fsdp"], devices, num_nodes)
    message = str(info.value)
    assert "the launcher (TorchElasticEnvironment) started" in message and want in message, message
    assert f"the Trainer has devices={devices} and num_nodes={num_nodes}" in message, message
    # every rank reads the same counts: reported once, by rank 0; this process (rank 1) prints one line naming it
    mark = info.value._mtraining_same_on_ranks
    assert (mark.rank, mark.reporter, mark.world_size) == (1, 0, 2)
    assert format_failure(info.value, mark).startswith("[rank1]: ValueError, reported by rank 0")


def test_without_the_launchers_counts_each_rank_checks_its_own_place(monkeypatch):
    """A launcher that does not state its processes per node (no LOCAL_WORLD_SIZE): a local rank beyond ``devices``,
    or a node other than the one the strategy cuts by, still fails at construction, on that rank."""
    from lightning_mtraining import MTrainingStrategy

    for key in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    _torchrun(monkeypatch, _without_counts(ONE_NODE_TWO_PROCESSES))
    with pytest.raises(ValueError, match=r"this process is local rank 1 \(global rank 1, node 0, TorchElastic"
                                         r"Environment\), but with devices=1 a node runs local ranks 0..0 only"):
        _trainer(MTrainingStrategy, 1, 2)
    _torchrun(monkeypatch, _without_counts(TWO_NODES_ONE_PROCESS))
    with pytest.raises(ValueError, match=r"global rank 1 runs on node 1 \(TorchElasticEnvironment\), but with "
                                         r"devices=2 and num_nodes=1 the strategy takes node 0 to hold ranks 0..1"):
        _trainer(MTrainingStrategy, 2, 1)


@pytest.mark.parametrize("variables, devices, num_nodes", [
    (ONE_NODE_TWO_PROCESSES, 2, 1), (TWO_NODES_ONE_PROCESS, 1, 2)])
def test_a_consistent_layout_builds(monkeypatch, variables, devices, num_nodes):
    from lightning_mtraining import MTrainingStrategy

    _torchrun(monkeypatch, variables)
    trainer = _trainer(MTrainingStrategy, devices, num_nodes)
    assert (trainer.global_rank, trainer.world_size, trainer.num_nodes) == (1, 2, num_nodes)
    _fabric(devices, num_nodes)
