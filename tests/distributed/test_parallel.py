"""``apply_context_parallel`` in a plain torch loop (no Lightning), with FSDP2 over the flattened (dp, cp) mesh:
the same losses and parameters as one device. Gloo, CPU."""

from __future__ import annotations

import pytest
import torch

from helpers.dist import run_distributed
from helpers.models import VOCAB
from helpers.models import make_model as tiny_model

SEQ, STEPS, LR = 45, 3, 0.5


def make_model():
    return tiny_model("qwen2", max_position_embeddings=256, tie_word_embeddings=True)


def samples(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (1, SEQ), generator=g) for _ in range(n)]


def reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: step s trains on samples s*dp .. s*dp+dp-1, the mean of their losses (what DP averages)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = samples(STEPS * dp)
    losses = []
    for s in range(STEPS):
        per = [model(input_ids=x, labels=x).loss for x in data[s * dp:(s + 1) * dp]]
        losses.append([x.item() for x in per])
        torch.stack(per).mean().backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _loop(rank: int, world_size: int, cp: int, fsdp: bool, fused: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_mtraining import apply_context_parallel

    dp = world_size // cp
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    model = make_model()
    handle = apply_context_parallel(model, mesh, block_size=4, fused_loss=fused)
    if fsdp:
        flat = mesh._flatten("dp_cp")
        for layer in model.model.layers:
            fully_shard(layer, mesh=flat)
        fully_shard(model, mesh=flat)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = samples(STEPS * dp)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for s in range(STEPS):
        x = data[s * dp + dp_rank]
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        losses.append(float(loss))
        loss.backward()
        if not fsdp:  # plain data parallel by hand: average the gradients over every rank
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        opt.zero_grad()
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.named_parameters()}
    handle.restore()
    return {"dp_rank": dp_rank, "losses": losses, "params": params, "attn": model.config._attn_implementation}


@pytest.mark.parametrize("world_size,cp,fsdp,fused", [(2, 2, True, True), (3, 3, True, False), (4, 2, True, True),
                                                      (3, 3, False, True)])
def test_plain_loop_matches_one_device(world_size, cp, fsdp, fused):
    results = run_distributed(_loop, world_size, cp, fsdp, fused, timeout=240)
    dp = world_size // cp
    ref_losses, ref_params = reference(dp)
    for r in results:
        for s in range(STEPS):
            # float32, the sharded ring and sums against one device: the tolerances of test_strategy.py
            assert abs(r["losses"][s] - ref_losses[s][r["dp_rank"]]) < 2e-5, (s, r["losses"], ref_losses)
        for name, want in ref_params.items():
            got = r["params"].get(name, r["params"].get(name.replace("lm_head", "model.embed_tokens")))
            torch.testing.assert_close(got, want, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")
        assert r["attn"] == "eager"


def test_mesh_without_the_cp_dimension_is_refused():
    from lightning_mtraining import apply_context_parallel

    class FakeMesh:
        mesh_dim_names = ("dp",)

    with pytest.raises(ValueError, match=r"the mesh has dimensions \('dp',\), none named 'cp'"):
        apply_context_parallel(make_model(), FakeMesh())
    with pytest.raises(ValueError, match="layout must be one of"):
        apply_context_parallel(make_model(), None, layout="diagonal")


def _dcp_worker(rank: int, world_size: int, ckpt_dir: str, phase: str) -> list[float]:
    """FSDP2 over a CP group of ``world_size``; ``phase="save"``: 2 steps, a distributed checkpoint (model and
    optimizer, sharded), 2 more steps; ``"resume"``: load that checkpoint (resharded to this world size), 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_mtraining import apply_context_parallel

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    model = make_model()
    handle = apply_context_parallel(model, mesh, block_size=4)
    flat = mesh._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x = samples(1)[0]

    def step():
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    losses = []
    if phase == "save":
        losses += [step(), step()]
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses += [step(), step()]
    handle.restore()
    return losses


def test_distributed_checkpoint_resumes_at_another_cp_size(tmp_path):
    """FSDP2 + CP 2 saves a sharded checkpoint (torch.distributed.checkpoint); CP 3 loads it resharded and
    continues with the losses of the uninterrupted CP 2 run (momentum: the optimizer state matters)."""
    saved = run_distributed(_dcp_worker, 2, str(tmp_path / "ckpt"), "save", timeout=240)[0]
    resumed = run_distributed(_dcp_worker, 3, str(tmp_path / "ckpt"), "resume", timeout=240)[0]
    assert saved[2] < saved[0]  # it trained
    # another CP size splits the float32 sums differently: the tolerance of the tests above
    for got, want in zip(resumed, saved[2:]):
        assert abs(got - want) < 2e-5, (resumed, saved)
