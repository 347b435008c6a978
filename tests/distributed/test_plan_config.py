"""A plan that runs: ``benchmarks/scale_model.py plan`` prints a LightningCLI config that ``examples/cli.py fit
--config`` accepts unchanged; the example cluster configs; the launch commands; the Lightning Studio job request.

- The CPU-sized config of a 2-node x 2-GPU plan runs for two steps as a Lightning Studio multi-machine job would
  start it (``python examples/cli.py fit --config FILE`` once per "machine", with ``NODE_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT``), and its mesh line is the plan's ring.
- The GPU configs (the planner's output, and ``examples/configs/cluster_*.yaml``) parse as they are and construct
  the strategy they name (on CPU: the accelerator is the only override), with the plan's sizes.
- The Studio helper's request binds to ``lightning_sdk.Job.run``'s documented keyword arguments (a stand-in with
  the same parameters as ``Job.run`` in lightning-sdk 2026.10.13 records them: no network, no SDK needed; the real
  signature is checked too where the SDK is installed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sm = _load("scale_model", ROOT / "benchmarks" / "scale_model.py")
cli_example = _load("mtraining_example_cli", ROOT / "examples" / "cli.py")


def _cli(args: list[str], monkeypatch):
    """LightningCLI of examples/cli.py on ``args``, instantiated (the Trainer and its strategy), not run."""
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(cli_example.CausalLMModule, cli_example.StdlibBytesDataModule, run=False, args=args)


def _plan(capsys, *args: str) -> tuple[str, dict]:
    """Run ``scale_model.py plan ARGS`` here; returns what it printed and the config it wrote."""
    sm.main(["plan", "--model", "Qwen/Qwen2.5-3B", *args])
    out = capsys.readouterr().out
    i = args.index("--config-out")
    text = Path(args[i + 1]).read_text()
    assert text in out  # the printed config is the written one
    return text, yaml.safe_load(text)


def _check_strategy(cli, config: dict) -> None:
    """The Trainer and strategy the CLI built are the config's."""
    from lightning_mtraining import MTrainingFSDPStrategy, MTrainingStrategy, SparsityConfig

    t = config["trainer"]
    s = t["strategy"]["init_args"]
    strategy = cli.trainer.strategy
    cls = MTrainingFSDPStrategy if t["strategy"]["class_path"].endswith("FSDPStrategy") else MTrainingStrategy
    assert type(strategy) is cls
    assert (cli.trainer.num_devices, cli.trainer.num_nodes) == (t["devices"], t["num_nodes"])
    assert (strategy.options.context_parallel_size, strategy.layout, strategy.block_size) == (
        s["context_parallel_size"], s["layout"], s["block_size"])
    assert (strategy.activation_checkpointing, strategy.offload_activations) == (
        s["activation_checkpointing"], s["offload_activations"])
    assert strategy.sparsity == SparsityConfig(**s["sparsity"]["init_args"])
    # the sizes against the world: what the strategy would build once launched
    assert (strategy.cp_size, strategy.inner_ring_size) == (s["context_parallel_size"], s["inner_ring_size"])


def test_plan_config_runs_as_a_studio_job(tmp_path, capsys):
    from lightning_mtraining.distributed.mesh import describe_mesh

    path = tmp_path / "plan_cpu.yaml"
    text, config = _plan(capsys, "--tokens", "4096", "--nodes", "2", "--gpus-per-node", "2", "--cp", "4", "--cpu",
                         "--config-out", str(path))
    t = config["trainer"]
    s = t["strategy"]["init_args"]
    assert (t["accelerator"], t["devices"], t["num_nodes"], t["max_steps"]) == ("cpu", 2, 2, 2)
    assert s["context_parallel_size"] == 4 and s["activation_checkpointing"] is True
    assert s["sparsity"]["init_args"] == {"top_p": 0.9, "max_vertical": 4096, "max_slash": 4096}
    assert "lightning job run --name mtraining --num-machines 2 --machine H100_X_2" in text

    # the two "machines" of a Studio job: the same command on each; Lightning starts each one's second process
    from helpers.launch import clean_env, free_port

    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--config", str(path)]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "NODE_RANK": str(node)}) for node in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-5000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in outputs[0]
    line = describe_mesh("MTrainingStrategy", 4, 4, s["inner_ring_size"], s["layout"], s["block_size"], num_nodes=2)
    assert outputs[0].count(line) == 1  # rank 0 (machine 0) logs the plan's ring once
    assert "(2 nodes x 2)" in line and ("inner (within a node)" in line or "flat ring of 4 across nodes" in line)


def test_plan_config_for_gpus_parses_unchanged(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.yaml"
    _, config = _plan(capsys, "--tokens", "4096", "--nodes", "2", "--gpus-per-node", "4", "--cp", "8",
                      "--max-steps", "7", "--config-out", str(path))
    t, m, d = config["trainer"], config["model"], config["data"]
    assert (t["accelerator"], t["devices"], t["num_nodes"], t["precision"], t["max_steps"]) == (
        "gpu", 4, 2, "bf16-mixed", 7)
    assert t["strategy"]["init_args"]["context_parallel_size"] == 8
    ref = sm.MODELS["Qwen/Qwen2.5-3B"]
    assert (m["family"], m["hidden_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"], m["vocab_size"],
            m["tie_word_embeddings"]) == ("qwen2", ref.hidden, ref.layers, ref.heads, ref.kv_heads, ref.vocab, True)
    assert d["seq_len"] == 4096 and m["max_position_embeddings"] == 4096

    cli = _cli(["--config", str(path), "--trainer.accelerator=cpu"], monkeypatch)  # no GPU here: the only override
    cli.parser.parse_args(["--config", str(path)])  # and as it is
    _check_strategy(cli, config)
    assert cli.trainer.strategy.inner_ring_size == 4  # CP 8 over 2 nodes of 4: an inner ring per node
    assert cli.datamodule.seq_len == 4096 and cli.model.hparams.hidden_size == ref.hidden


@pytest.mark.parametrize("name", ["cluster_1x8_128k", "cluster_4x8_512k", "cluster_4x8_2m"])
def test_example_cluster_configs(name, monkeypatch):
    path = CONFIGS / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    assert path.read_text().startswith("# made by: python benchmarks/scale_model.py plan ")
    nodes, tokens = {"cluster_1x8_128k": (1, 131072), "cluster_4x8_512k": (4, 524288),
                     "cluster_4x8_2m": (4, 2097152)}[name]
    t = config["trainer"]
    assert (t["devices"], t["num_nodes"], config["data"]["seq_len"]) == (8, nodes, tokens)
    cli = _cli(["--config", str(path), "--trainer.accelerator=cpu"], monkeypatch)
    cli.parser.parse_args(["--config", str(path)])
    _check_strategy(cli, config)
    if name == "cluster_4x8_2m":  # one sequence over all 32 GPUs: the hierarchical ring, an inner ring per node
        assert (cli.trainer.strategy.cp_size, cli.trainer.strategy.inner_ring_size) == (32, 8)


def test_plan_turns_on_offload_only_where_memory_needs_it():
    costs, rest = sm.measured_step_costs(), sm.measured_rest()
    ref, hw = sm.REFERENCE, sm.PRESETS["h100-ndr"]
    with_ckpt = sm.memory_gib(ref, 16384, 2, rest)
    offloaded = sm.memory_gib(ref, 16384, 2, rest, offload=True)
    assert offloaded["states_gib"] == with_ckpt["states_gib"]
    # offload moves the checkpointed layer inputs (2 bytes x layers x hidden per token) to the host
    moved = 8192 * 2 * ref.layers * ref.hidden / 2**30
    assert with_ckpt["activations_gib"] - offloaded["activations_gib"] == pytest.approx(moved)
    assert offloaded["host_gib"] == pytest.approx(moved)
    # the fewest layers that make it fit: half the moved bytes' worth of memory above "all offloaded" needs half of
    # the layers (rounded up), all of it needs every layer
    half = offloaded["total_gib"] + moved / 2
    layers_for_half = math.ceil(ref.layers / 2)
    cases = ((80.0, None, True, False), (half, None, False, layers_for_half),
             (offloaded["total_gib"] + 1e-9, None, False, True),
             (offloaded["total_gib"] - 0.1, None, False, False),
             # a host too small for the layers it would take (2 GPUs a node offload): nothing fits
             (half, 0.9 * 2 * moved / 2, False, False))
    for mem, host, fits, offload in cases:
        machine = dataclasses.replace(hw, gpu_mem_gib=mem, host_mem_gib=host)
        p = sm.plan(ref, machine, 16384, 1, 2, costs, rest, cp_sizes=[2])
        assert (p["best"]["fits"], p["best"]["offload"]) == (fits, offload), (mem, host)
        config = sm.plan_config(p, "Qwen/Qwen2.5-3B", ref, 16384, 1, 2)
        init = config["trainer"]["strategy"]["init_args"]
        assert init["offload_activations"] == offload and init["activation_checkpointing"] is True
        assert type(init["offload_activations"]) is type(offload)  # True (every layer) or a count, never 1 for True
        if offload:
            cpu = sm.plan_config(p, "Qwen/Qwen2.5-3B", ref, 16384, 1, 2, cpu=True)
            assert cpu["trainer"]["strategy"]["init_args"]["offload_activations"] is True  # the tiny model: all
        text = sm._fmt_plan(p, "Qwen/Qwen2.5-3B", machine, 16384, 1, 2)
        assert ("fits with activation offload" in text) == bool(offload)
        assert (f"offload_activations={offload}" in text) == bool(offload)
        assert ("does NOT fit" in text) == (not fits and not offload)


def test_trainer_config_and_launch_commands():
    from lightning_mtraining import SparsityConfig
    from lightning_mtraining.strategies.cluster import cli_command, launch_commands, sparsity_init, trainer_config

    t = trainer_config(nodes=4, devices=8, context_parallel_size=32, max_steps=5)
    init = t["strategy"]["init_args"]
    assert (t["devices"], t["num_nodes"], init["context_parallel_size"], init["inner_ring_size"]) == (8, 4, 32, 8)
    assert t["max_steps"] == 5 and t["strategy"]["class_path"] == "lightning_mtraining.MTrainingStrategy"
    fsdp = trainer_config(nodes=1, devices=8, context_parallel_size=8, sparsity=None, fsdp=True)
    assert fsdp["strategy"]["init_args"]["sparsity"] is None
    assert fsdp["strategy"]["class_path"] == "lightning_mtraining.MTrainingFSDPStrategy"
    with pytest.raises(ValueError, match="context_parallel_size=3 does not divide the world size 8"):
        trainer_config(nodes=1, devices=8, context_parallel_size=3)
    with pytest.raises(ValueError, match="inner_ring_size=3 does not divide context_parallel_size=8"):
        trainer_config(nodes=1, devices=8, context_parallel_size=8, inner_ring_size=3)
    with pytest.raises(ValueError, match=r"trainer_config\(layout=...\) must be one of"):
        trainer_config(nodes=1, devices=8, context_parallel_size=8, layout="diagonal")
    with pytest.raises(ValueError, match="trainer_config: "):  # 128-token tiles cannot tile 64-token blocks
        trainer_config(nodes=1, devices=8, context_parallel_size=8, block_size=64)
    topk = sparsity_init(SparsityConfig(vertical_topk=64, slash_topk=16, tile_size=32, dense_layers=(0, 1),
                                        budgets={2: (8, 4)}))
    assert topk["init_args"] == {"vertical_topk": 64, "slash_topk": 16, "tile_size": 32, "dense_layers": [0, 1],
                                 "budgets": {2: [[8, 4]]}}
    assert yaml.safe_load(yaml.safe_dump(topk)) == topk  # plain YAML: no tuples
    assert SparsityConfig(**topk["init_args"]) == SparsityConfig(vertical_topk=64, slash_topk=16, tile_size=32,
                                                                 dense_layers=(0, 1), budgets={2: (8, 4)})

    cmd = cli_command("plan.yaml")
    assert cmd == "python examples/cli.py fit --config plan.yaml"
    one = launch_commands("examples/cli.py fit --config plan.yaml", nodes=1, devices=8)
    assert one["python"] == cmd
    assert one["torchrun"] == "torchrun --nproc-per-node 8 examples/cli.py fit --config plan.yaml"
    four = launch_commands("examples/cli.py fit --config plan.yaml", nodes=4, devices=8, studio="s", machine="H200_X_8")
    assert four["torchrun"].startswith("torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK "
                                       "--master-addr $MASTER_ADDR --master-port 29500 examples/cli.py")
    assert four["slurm"] == f"srun --nodes 4 --ntasks-per-node 8 {cmd}"
    assert four["studio"] == (f"lightning job run --name mtraining --num-machines 4 --machine H200_X_8 --studio s "
                              f"--command '{cmd}'")


class _FakeJob:
    """Stands in for ``lightning_sdk.Job``: ``run`` has the keyword arguments the SDK documents for
    ``Job.run`` and records what it was called with."""

    calls: list[dict] = []

    @classmethod
    def run(cls, name, machine, cloud=None, command=None, studio=None, image=None, teamspace=None, org=None,
            user=None, env=None, interruptible=False, image_credentials=None, cloud_account_auth=False,
            entrypoint=None, path_mappings=None, max_runtime=None, max_run_attempts=None, reuse_snapshot=True,
            scratch_disks=None, placement_group_id=None, num_machines=1, tags=None, keep_minutes=None):
        cls.calls.append(dict(inspect.signature(cls.run).bind(name, machine, cloud, command, studio, image, teamspace,
                                                              org, user, env, interruptible).arguments,
                              num_machines=num_machines, max_runtime=max_runtime))
        return f"Job({name})"


@pytest.fixture
def fake_sdk(monkeypatch):
    _FakeJob.calls = []
    monkeypatch.setitem(sys.modules, "lightning_sdk", types.SimpleNamespace(Job=_FakeJob))
    return _FakeJob


def test_studio_job_request(fake_sdk):
    from lightning_mtraining.strategies.cluster import machine_gpus, studio_job_request, submit_studio_job

    assert [machine_gpus(m) for m in ("H100_X_8", "A100_X_4", "L4", "CPU", "CPU_X_16")] == [8, 4, 1, None, None]
    assert machine_gpus(types.SimpleNamespace(name="X", family="H100", accelerator_count=2)) == 2
    req = studio_job_request("python examples/cli.py fit --config plan.yaml", name="mt", machine="H100_X_8",
                             num_machines=4, devices=8, studio="my-studio", cwd="/teamspace/studios/this_studio/repo",
                             max_runtime=3600)
    assert req == {"name": "mt", "machine": "H100_X_8", "num_machines": 4, "studio": "my-studio", "max_runtime": 3600,
                   "command": "cd /teamspace/studios/this_studio/repo && python examples/cli.py fit --config plan.yaml"}
    inspect.signature(_FakeJob.run).bind(**req)  # every key is a Job.run keyword
    with pytest.raises(ValueError, match="devices=8 processes per machine but machine 'H100_X_4' has 4 GPUs"):
        studio_job_request("python x.py", name="mt", machine="H100_X_4", num_machines=2, devices=8)
    with pytest.raises(ValueError, match="num_machines must be a positive int"):
        studio_job_request("python x.py", name="mt", machine="H100", num_machines=0)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        studio_job_request("python x.py", name="", machine="H100", num_machines=1)

    assert submit_studio_job("python x.py", name="mt", machine="H100_X_2", num_machines=2, devices=2) == "Job(mt)"
    call = fake_sdk.calls[-1]
    assert (call["name"], call["machine"], call["command"], call["num_machines"]) == ("mt", "H100_X_2",
                                                                                      "python x.py", 2)


def test_studio_job_without_the_sdk(monkeypatch):
    from lightning_mtraining.strategies.cluster import submit_studio_job

    monkeypatch.setitem(sys.modules, "lightning_sdk", None)  # `import lightning_sdk` raises ImportError
    with pytest.raises(ImportError, match=r"needs the Lightning SDK, which is not installed: pip install "):
        submit_studio_job("python x.py", name="mt", machine="H100_X_8", num_machines=2, devices=8)


def test_plan_submits_a_studio_job(tmp_path, capsys, fake_sdk):
    path = tmp_path / "plan.yaml"
    sm.main(["plan", "--tokens", "4096", "--nodes", "2", "--gpus-per-node", "2", "--cp", "4", "--config-out",
             str(path), "--studio-job", "mt-plan", "--machine", "H100_X_2", "--studio", "my-studio"])
    assert "submitted Lightning Studio job 'mt-plan' on 2 x H100_X_2: Job(mt-plan)" in capsys.readouterr().out
    call = fake_sdk.calls[-1]
    assert (call["name"], call["machine"], call["num_machines"], call["studio"]) == ("mt-plan", "H100_X_2", 2,
                                                                                     "my-studio")
    assert call["command"] == f"python examples/cli.py fit --config {path}"
    with pytest.raises(SystemExit, match="--studio-job needs --config-out"):
        sm.main(["plan", "--tokens", "4096", "--nodes", "2", "--gpus-per-node", "2", "--studio-job", "x"])


def test_studio_job_request_binds_to_the_real_sdk():
    sdk = pytest.importorskip("lightning_sdk")
    from lightning_mtraining.strategies.cluster import studio_job_request

    req = studio_job_request("python x.py", name="mt", machine="H100_X_8", num_machines=4, devices=8, studio="s",
                             teamspace="t", env={"A": "1"}, interruptible=True)
    inspect.signature(sdk.Job.run).bind(**req)
