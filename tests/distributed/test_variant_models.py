"""Models with sliding-window layers and soft-capping under context parallelism: the same losses and parameters as
one device. ``apply_context_parallel`` in a plain SGD loop on 2 and 3 gloo ranks, CPU, float32.

- Gemma 2: alternating sliding-window and full layers, attention soft-cap 3 (scores of this tiny random model
  reach it), final logit soft-cap.
- Mistral: one window for every layer (no ``layer_types``).
- Qwen2 with ``use_sliding_window``: full layers below ``max_window_layers``, windows above.

Windows shorter (7) and longer (200) than the 90-token sequence. Dense: against the unchanged model with eager
attention on one device. Sparse: against the same sparse configuration on one device (the pattern is global, so
it is the same at every world size); its window layers run their band exactly, its full layers the estimated
pattern.
"""

from __future__ import annotations

import pytest
import torch

from helpers.dist import run_distributed
from helpers.models import VOCAB
from helpers.models import make_model as tiny_model

SEQ, STEPS, LR = 90, 2, 0.5


def make_model(family: str, window: int):
    if family == "gemma2":
        model = tiny_model("gemma2", max_position_embeddings=256, head_dim=8, sliding_window=window,
                           attn_logit_softcapping=3.0, final_logit_softcapping=5.0, query_pre_attn_scalar=8)
        assert model.config.layer_types == ["sliding_attention", "full_attention"]
    elif family == "mistral":
        model = tiny_model("mistral", max_position_embeddings=256, sliding_window=window)
    else:
        model = tiny_model("qwen2", max_position_embeddings=256, use_sliding_window=True, sliding_window=window,
                           max_window_layers=1)
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    return model


def sparsity():
    from lightning_mtraining import SparsityConfig

    # small budgets so the full layers' patterns really are sparse at 96 tokens (6 tiles of 16)
    return SparsityConfig(vertical_topk=3, slash_topk=2, last_q=8, tile_size=16, sink_tokens=1, local_window=1)


def samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (1, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, shard) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x in samples():
        loss = model(**shard({"input_ids": x, "labels": x})).loss
        losses.append(float(loss.detach()))
        loss.backward()
        if torch.distributed.is_initialized():  # each rank's loss is C / N x its token-loss sum: the mean of
            for p in model.parameters():        # the gradients over the group is one device's gradient
                torch.distributed.all_reduce(p.grad)
                p.grad /= torch.distributed.get_world_size()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _worker(rank: int, world_size: int, family: str, window: int, sparse: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    model = make_model(family, window)
    handle = apply_context_parallel(model, mesh, block_size=16, sparsity=sparsity() if sparse else None)
    return _train(model, handle.shard)


def reference(family: str, window: int, sparse: bool):
    from lightning_mtraining import apply_context_parallel

    model = make_model(family, window)
    if not sparse:
        return _train(model, lambda b: b)
    handle = apply_context_parallel(model, None, block_size=16, sparsity=sparsity())
    return _train(model, handle.shard)


@pytest.mark.parametrize("family, world_size, window, sparse", [
    ("gemma2", 3, 7, True), ("gemma2", 3, 200, False),
    ("mistral", 3, 7, False), ("mistral", 2, 7, True), ("qwen2", 3, 7, True),
])
def test_window_and_softcap_models_match_one_device(family, world_size, window, sparse):
    want_losses, want_params = reference(family, window, sparse)
    results = run_distributed(_worker, world_size, family, window, sparse, timeout=240)
    for losses, params in results:
        # float32, the sharded ring and the CP sums against one device: the tolerances of test_parallel.py
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 2e-5, (losses, want_losses)
        for name, want in want_params.items():
            torch.testing.assert_close(params[name], want, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")
    if sparse:
        gap = abs(want_losses[0] - reference(family, window, False)[0][0])
        if family == "mistral":  # every layer has a window, whose band is computed exactly: sparse is dense here
            assert gap < 2e-5
        else:  # the full layers' patterns are really sparse: the losses differ from dense attention's
            assert gap > 1e-4
    if window < SEQ and not sparse:  # the window matters at this size: without it the first loss differs
        plain = make_model(family, 10_000)  # the same weights, a window longer than the sequence
        x = samples()[0]
        with torch.no_grad():
            assert abs(float(plain(input_ids=x, labels=x).loss) - want_losses[0]) > 1e-4  # 5x the tolerance
