"""The dense decision read after the launch (``PendingLayerPattern``, a GPU's path) on 3 gloo ranks: the layers' guesses
go wrong in several forwards (the decision flips between steps), the ranks run the extra attention together, and a
checkpointed model trains to exactly the losses and gradients of the decision read at once."""

from __future__ import annotations

import dataclasses

import torch

from helpers.dist import run_distributed
from helpers.models import VOCAB, make_model

SEQ = 384  # 3 ranks x 128 (striped blocks of 16, whole tiles of 16 per rank)
# dense_above per step: never dense, every head dense, again, never: each layer's guess (its last outcome) is wrong
# at steps 1 and 3 and right at steps 0 and 2
THRESHOLDS = (None, 0.0, 0.0, None)


def _train(rank: int, world_size: int, deferred: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_mtraining.sparsity.pattern as pattern_mod
    from lightning_mtraining import SparsityConfig, apply_context_parallel
    from lightning_mtraining.sparsity.pattern import PendingLayerPattern

    if deferred:
        pattern_mod.READ_LATER_ON = {"cpu", "cuda"}
    made = []
    real_init = PendingLayerPattern.__init__

    def counting(self, *args, **kwargs):
        made.append(kwargs.get("guess"))
        real_init(self, *args, **kwargs)

    PendingLayerPattern.__init__ = counting
    base = SparsityConfig(top_p=0.9, last_q=8, sink_tokens=2, local_window=16, tile_size=16, max_vertical=16,
                          max_slash=16)
    model = make_model("qwen2", seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    handle = apply_context_parallel(model, mesh, block_size=16, sparsity=base, fused_loss=False)
    handle.schedule.log_every_n_steps = 0  # no measured step: every forward guesses
    g = torch.Generator().manual_seed(5)
    losses, grads = [], []
    for step, above in enumerate(THRESHOLDS):
        cfg = dataclasses.replace(base, dense_above=1.0 if above is None else above)
        handle.schedule.layer_sparsity = lambda layer, cfg=cfg: cfg
        handle.schedule.set_step(step)
        x = torch.randint(1, VOCAB, (1, SEQ), generator=g)
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
        losses.append(float(loss))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        model.zero_grad()
    PendingLayerPattern.__init__ = real_init
    return {"losses": losses, "grads": grads, "guesses": made, "layers": model.config.num_hidden_layers}


def test_wrong_guesses_on_three_ranks_train_exactly_as_an_immediate_read():
    at_once = run_distributed(_train, 3, False, timeout=300)
    later = run_distributed(_train, 3, True, timeout=300)
    layers = later[0]["layers"]
    for r in range(3):
        assert at_once[r]["guesses"] == []  # the CPU reads at once unless told otherwise
        # one pending decision per layer and forward (the recompute reuses it); the guesses follow the outcomes
        assert later[r]["guesses"] == ["sparse"] * layers * 2 + ["dense"] * layers * 2
        for s in range(len(THRESHOLDS)):
            # the same pattern and the same attention path: equal up to the order of float32 sums (1e-6)
            assert abs(later[r]["losses"][s] - at_once[r]["losses"][s]) < 1e-6, (r, s)
            for name, want in at_once[r]["grads"][s].items():
                torch.testing.assert_close(later[r]["grads"][s][name], want, rtol=0, atol=1e-6)
