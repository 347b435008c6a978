"""A training step of a checkpointed bf16 model whose forward and recompute run under different default dtypes, with
``dense_above`` put exactly at a head's share of its pairs (``tests/unit/test_dense_decision.py`` on CPU,
``tests/gpu/test_hot_path_gpu.py`` on CUDA)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch

import lightning_mtraining.sparsity.pattern as pattern_mod
from helpers.models import VOCAB, make_model
from lightning_mtraining.sparsity.pattern import head_pairs


def checkpointed_step_at_threshold(family: str, device: torch.device, monkeypatch, seq: int = 512,
                                   measure: bool = True, straight: bool = True, **overrides):
    """Train with head 0 of layer 0 just above ``dense_above`` where a bf16 comparison would say "below".

    ``straight`` (the strategies' path where it applies, Note [The straight path] in ``lightning_mtraining.ring.
    straight``): the first step decides on the device, exactly (head 0 dense), and the second step runs that head
    dense in its forward and its recompute alike (one record per layer and forward); returns the second step's
    record of layer 0 (a ``LayerRun``) and None. Else the general path (``plan.straight_path = False``): one step,
    one dense-or-sparse decision per layer (the recompute reused the forward's); where the decision is read after the
    launch (``PendingLayerPattern``: CUDA, or CPU when the caller adds it to ``READ_LATER_ON``), layer 0's first guess
    (no head dense) is wrong: its forward runs twice and the recompute replays both. Returns the schedule's record of
    layer 0 and what its forward ran (``runs``, None when read at once). ``measure=False``: the step is not a
    measured one (a measured step reads the decision before the launch, for its statistics)."""
    from lightning_mtraining import SparsityConfig, apply_context_parallel

    cfg = SparsityConfig(top_p=0.9, last_q=8, sink_tokens=2, local_window=16, tile_size=16, max_vertical=8,
                         max_slash=16, dense_above=None)
    x = torch.randint(1, VOCAB, (1, seq), generator=torch.Generator().manual_seed(3)).to(device)

    def prepared(config):
        model = make_model(family, seed=0, **overrides).to(device=device, dtype=torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        handle = apply_context_parallel(model, block_size=16, sparsity=config, fused_loss=False)
        handle.plan.straight_path = straight
        return model, handle

    # the first forward's patterns, to put dense_above exactly at a head's share
    model, handle = prepared(cfg)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.no_grad():
            model(**handle.shard({"input_ids": x}))
    finally:
        torch.set_default_dtype(torch.float32)
    first = handle.schedule._patterns[0]
    estimated = first.estimate.pattern if straight else first.estimated
    allowed, causal = head_pairs(estimated.to("cpu"), [seq])
    a, c = int(allowed[0, 0]), int(causal[0])
    # a threshold just below head 0's share (so it runs dense) where a bf16 comparison says "not above": the forward
    # (bf16 default dtype) and the recompute (float32) disagreed there when the comparison ran in the default dtype
    # (where none does for this pattern, the closest threshold below the share: still one path per layer)
    candidates = [a / c * (1 - e / 1e4) for e in range(1, 80)]
    exact_dense = [t for t in candidates if a > Fraction(t) * c]
    bf16 = lambda x: float(torch.tensor(x, dtype=torch.bfloat16))  # noqa: E731
    thr = next((t for t in exact_dense if not bf16(a) > bf16(t * c)), exact_dense[0])

    def step(model, handle) -> None:
        """A training step whose forward runs under a bf16 default dtype and whose recompute under float32."""
        torch.set_default_dtype(torch.bfloat16)
        try:
            loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        finally:
            torch.set_default_dtype(torch.float32)
        loss.backward()  # the checkpointed layers recompute here, under float32
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

    if straight:
        model, handle = prepared(dataclasses.replace(cfg, dense_above=thr))
        if not measure:
            handle.schedule.log_every_n_steps = 0
        records = []
        for _ in range(2):
            step(model, handle)
            records.append(handle.schedule._patterns[0])
        first, second = records
        assert bool(first.estimate.decided[0, 0])  # decided on the device, in float64: exact at the threshold
        assert first.estimate.dense is None and second.estimate.dense[0][0]  # the next forward runs it dense
        assert handle.schedule.estimations == 2 * model.config.num_hidden_layers  # the recomputes reused the records
        return second

    decisions = []
    real = pattern_mod._device_decision

    def counting(*args, **kwargs):
        decisions.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(pattern_mod, "_device_decision", counting)
    model, handle = prepared(dataclasses.replace(cfg, dense_above=thr))
    if not measure:
        handle.schedule.log_every_n_steps = 0
    step(model, handle)
    assert len(decisions) == model.config.num_hidden_layers  # the recompute reused the forward's record
    record = handle.schedule._patterns[0]
    assert record.dense[0, 0]  # head 0 ran dense, in the forward and the recompute alike
    return record
