"""The N-dimensional mesh (dp_replicate x dp_shard x cp x tp): tensor parallel decoder layers (torch's
``parallelize_module``), ring attention over ``cp``, FSDP2 over dp x cp, in a plain torch loop on gloo CPU ranks.

Compared against one device running the same float32 model on the same samples, in one launch of 8 ranks (each DP
group of DP 2 x CP 2 x TP 2 is a TP 2 x CP 2 grid): losses after each step and the gathered full parameters.
``Trainer`` with ``MTrainingFSDPStrategy`` at DP-replicate 2 x CP 2 x TP 2, dense; the plain loop
(``apply_context_parallel`` + ``apply_fsdp``) at DP-shard 2 x CP 2 x TP 2, sparse with per-KV-head budgets; its
distributed checkpoint resumed at DP-replicate 2 x CP 4 x TP 1 (HSDP) with the uninterrupted run's next losses and
parameters, the SGD momentum included.
"""

from __future__ import annotations

import pytest
import torch

from helpers.dist import run_distributed
from helpers.training import check_against_reference

VOCAB, SEQ, STEPS, LR, CKPT_STEP = 64, 40, 2, 0.2, 1


def make_model(family: str = "qwen2", **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager",
                  initializer_range=0.3, tie_word_embeddings=False)
    config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**{**fields, **overrides})
    return AutoModelForCausalLM.from_config(config).float()


def samples(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (1, SEQ), generator=g) for _ in range(n)]


def sparsity():
    from lightning_mtraining import SparsityConfig

    # per-KV-head budgets that differ, so each tp rank must take its own (4 query heads, 2 KV groups, tp 2: one
    # each); sparse enough that the first loss moves by 0.03 from dense. No dense fallback: a forward's dense heads
    # are the decision of the one before (per batch row), which the one-device reference's separate forwards per
    # DP rank would not reproduce, nor a plain loop's checkpoint (model and optimizer) carry
    return SparsityConfig(vertical_topk=(4, 2), slash_topk=(1, 0), last_q=8, sink_tokens=2, local_window=1,
                          tile_size=16, pattern_heads="kv", dense_above=None)


def make_optimizer(model):
    # momentum: optimizer state that a checkpoint must carry. (AdamW's normalised step would turn the float32 noise
    # of k_proj.bias's gradient, zero in exact arithmetic since softmax ignores the q . b_k added to a whole score
    # row, into +-lr moves that differ by layout: no parameter tolerance would then mean anything.)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def reference(dp: int, sparse: bool = False, steps: int = STEPS,
              forget_at: int = -1) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One device: step s trains on samples s*dp .. s*dp+dp-1, the mean of their losses (what DP averages).
    ``forget_at``: a fresh optimizer after that many steps (a resume that lost the optimizer state)."""
    from lightning_mtraining import apply_context_parallel

    model = make_model()
    handle = apply_context_parallel(model, None, block_size=16, sparsity=sparsity() if sparse else None)
    opt = make_optimizer(model)
    data = samples(16)
    losses = []
    for s in range(steps):
        if s == forget_at:
            opt = make_optimizer(model)
        per = [model(**handle.shard({"input_ids": x, "labels": x})).loss for x in data[s * dp:(s + 1) * dp]]
        losses.append([float(x.detach()) for x in per])
        torch.stack(per).mean().backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _full(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}


def _run(sizes: dict, *, sparse: bool = False, steps: int = STEPS, ckpt: str | None = None, save_at: int = -1) -> dict:
    """Train ``steps`` steps on the layout ``sizes`` (sample ``s * dp + dp_rank`` at step s). ``save_at``: write a
    distributed checkpoint (model and optimizer state, sharded as laid out) to ``ckpt`` after that many steps;
    ``ckpt`` without ``save_at``: first load it (resharded to this layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_mtraining import apply_context_parallel
    from lightning_mtraining.distributed import MeshAxes, build_mesh
    from lightning_mtraining.hf import apply_fsdp

    mesh = build_mesh("cpu", **sizes)
    axes = MeshAxes.of(mesh)
    model = make_model()
    handle = apply_context_parallel(model, mesh, block_size=16 if sparse else 4,
                                    sparsity=sparsity() if sparse else None)
    q = model.model.layers[0].self_attn.q_proj.weight
    local_q = (q.to_local() if hasattr(q, "to_local") else q).shape[0]
    apply_fsdp(model, mesh)
    opt = make_optimizer(model)
    data = samples(16)
    first = 0
    if ckpt is not None and save_at < 0:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = CKPT_STEP
    losses = []
    for s in range(first, first + steps):
        x = data[s * axes.dp + axes.dp_rank]
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if s + 1 == save_at:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    handle.restore()
    return {"dp_rank": axes.dp_rank, "losses": losses, "params": _full(model), "local_q_rows": local_q,
            "axes": axes}


# clip: the gradient norm over parameters on two meshes (tensor_parallel.clip_grad_norm_, torch's refuses them)
TRAINER_SCENARIO = dict(family="qwen2", n_samples=8, seq_len=13, steps=2, fsdp=True, clip=0.05,
                       strategy=dict(block_size=4, context_parallel_size=2, tensor_parallel_size=2,
                                     data_parallel_replicate_size=2, sparsity=None))


def _eight(rank: int, world_size: int, ckpt: str) -> dict:
    from helpers.training import elastic_env, fit

    elastic_env(rank, world_size, world_size)
    return {
        # the Trainer strategy, dense: MTrainingFSDPStrategy at HSDP 2 x CP 2 x TP 2 (test_strategy's module, data)
        "trainer": fit(world_size, TRAINER_SCENARIO),
        # the plain loop, sparse: FSDP2 over dp_shard 2 x cp 2, TP 2; a checkpoint after the first step
        "sparse": _run(dict(dp_shard=2, cp=2, tp=2), sparse=True, steps=CKPT_STEP + 2, ckpt=ckpt,
                       save_at=CKPT_STEP),
        # that checkpoint at TP 1 x CP 4, HSDP (replicated over dp_replicate 2): each rank now estimates every head
        "resume": _run(dict(dp_replicate=2, cp=4, tp=1), sparse=True, steps=2, ckpt=ckpt),
    }


def _assert_matches(result: dict, ref: tuple, what: str, first: int = 0) -> None:
    ref_losses, ref_params = ref
    for i, got in enumerate(result["losses"]):
        # float32; the ring's blockwise merge, the row-wise layers' all-reduce of partial sums and FSDP's
        # reduce-scatter sum in another order than one device: the tolerances of test_parallel.py
        assert abs(got - ref_losses[first + i][result["dp_rank"]]) < 2e-5, (what, i, result["losses"], ref_losses)
    for name, want in ref_params.items():
        torch.testing.assert_close(result["params"][name], want, rtol=0, atol=5e-5,
                                   msg=lambda m: f"{what} {name}: {m}")


def test_dp_cp_tp_meshes_match_one_device_and_checkpoints_move_across_layouts(tmp_path):
    """One launch of 8 gloo ranks: the Trainer strategy at DP-replicate 2 x CP 2 x TP 2 (dense); the plain loop at
    DP-shard 2 x CP 2 x TP 2 (sparse), its checkpoint resumed at DP-replicate 2 x CP 4 x TP 1 (HSDP)."""
    results = run_distributed(_eight, 8, str(tmp_path / "ckpt"), timeout=400)
    # the Trainer: test_strategy's reference protocol; a DP group there is the cp x tp ranks that share samples
    trainer = [dict(r["trainer"], cp_size=r["trainer"]["cp_size"] * 2) for r in results]
    check_against_reference(trainer, TRAINER_SCENARIO)
    assert all(r["sharded"] for r in trainer)
    assert results[0]["trainer"]["mesh"][0] == ("dp_replicate", "dp_shard", "cp", "tp")

    sparse = reference(2, sparse=True, steps=CKPT_STEP + 2)
    for r in results:
        assert r["sparse"]["local_q_rows"] == 64 // 2  # tp 2: each rank holds half of q_proj's output rows
        assert r["resume"]["local_q_rows"] == 64  # tp 1: whole
        _assert_matches(r["sparse"], sparse, "DP-shard 2 x CP 2 x TP 2, sparse")
        # TP 2 x CP 2 x DP-shard 2 -> TP 1 x CP 4 x DP-replicate 2: another split of the same float32 sums, with
        # the momentum restored: the uninterrupted run's next losses, and its parameters at the end
        _assert_matches(r["resume"], sparse, "resumed at TP 1 x CP 4, HSDP", first=CKPT_STEP)
        for got, want in zip(r["resume"]["losses"], r["sparse"]["losses"][CKPT_STEP:]):
            assert abs(got - want) < 2e-5, (r["resume"]["losses"], r["sparse"]["losses"])
    # the test can tell: the sparse pattern is not the dense one, and a resume without the momentum has another
    # second loss
    dense = reference(2, steps=1)
    assert abs(sparse[0][0][0] - dense[0][0][0]) > 1e-3, (sparse[0], dense[0])
    forgot = reference(2, sparse=True, steps=CKPT_STEP + 2, forget_at=CKPT_STEP)[0]
    assert abs(forgot[CKPT_STEP + 1][0] - sparse[0][CKPT_STEP + 1][0]) > 1e-3, (forgot, sparse[0])


def test_mesh_and_model_size_errors():
    from transformers import Qwen3Config

    from lightning_mtraining.distributed.mesh import check_mesh_fits_model, resolve_mesh_sizes
    from lightning_mtraining.hf.tensor_parallel import layer_tp_plan

    assert resolve_mesh_sizes(8, cp=2, tp=2) == (1, 2, 2, 2)
    assert resolve_mesh_sizes(12, dp_replicate=3, dp_shard=1, cp=4) == (3, 1, 4, 1)
    with pytest.raises(ValueError, match=r"world of 6 ranks is not divisible by .* = 4"):
        resolve_mesh_sizes(6, cp=2, tp=2)
    with pytest.raises(ValueError, match=r"dp_replicate 1 x dp_shard 3 x cp 2 x tp 2 = 12 ranks, but the world has 8"):
        resolve_mesh_sizes(8, dp_shard=3, cp=2, tp=2)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        resolve_mesh_sizes(8, tp=0)
    config = make_model().config  # 4 heads, 2 KV heads, intermediate 96
    check_mesh_fits_model(config, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the tensor parallel size 3"):
        check_mesh_fits_model(config, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is fewer than the tensor parallel size 4"):
        check_mesh_fits_model(config, 4)
    config.num_attention_heads, config.num_key_value_heads = 12, 6
    with pytest.raises(ValueError, match="num_key_value_heads=6 is not divisible by the tensor parallel size 4"):
        check_mesh_fits_model(config, 4)
    config.num_attention_heads, config.num_key_value_heads, config.intermediate_size = 4, 4, 98
    with pytest.raises(ValueError, match="intermediate_size=98 is not divisible"):
        check_mesh_fits_model(config, 4)

    assert layer_tp_plan(make_model("llama"))["self_attn.o_proj"] == "rowwise"
    qwen3 = type("Qwen3Like", (), {"config": Qwen3Config()})()
    with pytest.raises(ValueError, match="'layers.*.self_attn.q_norm' the style 'replicated_with_grad_allreduce'"):
        layer_tp_plan(qwen3)


def test_local_sparsity_takes_the_ranks_heads():
    from lightning_mtraining import SparsityConfig
    from lightning_mtraining.hf.tensor_parallel import local_sparsity

    cfg = SparsityConfig(vertical_topk=(1, 2, 3, 4), slash_topk=5, budgets={0: [(1, 2), (3, 4), (5, 6), (7, 8)],
                                                                            1: (9, 9)})
    second = local_sparsity(cfg, 1, 2)
    assert second.vertical_topk == (3, 4) and second.slash_topk == 5
    assert second.head_budgets(2, 0) == ([5, 7], [6, 8]) and second.head_budgets(2, 1) == ([9, 9], [9, 9])
    assert local_sparsity(cfg, 0, 1) is cfg and local_sparsity(None, 0, 2) is None
    with pytest.raises(ValueError, match="4 per-head budgets, not divisible by the tensor parallel size 3"):
        local_sparsity(cfg, 0, 3)


def test_fsdp_strategy_sizes():
    """MTrainingFSDPStrategy's mesh sizes and ranks, before any process group: rank = ((r S + s) C + c) T + t."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_mtraining import MTrainingFSDPStrategy

    def strategy(world: int, rank: int, **kwargs):
        s = MTrainingFSDPStrategy(**kwargs)
        s.cluster_environment, s.parallel_devices = LightningEnvironment(), [torch.device("cpu")] * world
        s.cluster_environment.set_world_size(world)
        s.cluster_environment.set_global_rank(rank)
        return s

    s = strategy(16, 13, tensor_parallel_size=2, data_parallel_replicate_size=2)  # cp "auto": 16 / (2 x 2) = 4
    assert (s.cp_size, s.dp_size, s.cp_rank, s.dp_rank) == (4, 2, 2, 1)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1} and s.inner_ring_size == 4
    s = strategy(8, 5, tensor_parallel_size=2, context_parallel_size=2)  # dp_shard 2
    assert (s.cp_size, s.dp_size, s.cp_rank, s.dp_rank) == (2, 2, 0, 1)
    with pytest.raises(ValueError, match=r"dp_replicate 1 x dp_shard 1 x cp 3 x tp 2 = 6 ranks, but the world has 8|"
                                         r"not divisible by dp_replicate 1 x cp 3 x tp 2"):
        _ = strategy(8, 0, tensor_parallel_size=2, context_parallel_size=3).cp_size
    with pytest.raises(ValueError, match="world of 6 ranks is not divisible by data_parallel_replicate_size 1 x "
                                         "tensor_parallel_size 4"):
        _ = strategy(6, 0, tensor_parallel_size=4).cp_size
    with pytest.raises(ValueError, match="hierarchical rings are not built"):
        _ = strategy(8, 0, tensor_parallel_size=2, inner_ring_size=2).inner_ring_size
    with pytest.raises(ValueError, match=r"tensor_parallel_size=\.\.\.\) must be a positive int, got 0"):
        MTrainingFSDPStrategy(tensor_parallel_size=0)
