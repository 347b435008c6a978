"""Bit-identical reruns on the GPU: the same model, data and seed give the same losses and parameters, bit for bit,
whether attention runs dense (SDPA at one device) or sparse (the pattern estimated online, the Triton/Gluon kernels),
with the default fused loss. Skipped without a GPU.

Why it holds: the sparse kernels' backward has no floating-point atomics (one writer per dq / dk / dv element, the
column partials summed in a fixed order: ``mtraining_kernels.vertical_slash``), the estimator's sums are in a fixed
order and its few atomic adds see at most two non-zero terms (``lightning_mtraining.sparsity.estimation``), and
selection is by packed unique keys. What else a step runs (cuBLAS matmuls, SDPA, the fused loss) runs under
``torch.use_deterministic_algorithms(True)`` here, the mode a user sets with ``Trainer(deterministic=True)``; its cost
for a training step is measured by ``benchmarks/train_throughput.py --deterministic``.
"""

from __future__ import annotations

import os

import pytest
import torch

# cuBLAS reads it when it first initialises, which a GPU suite may do before this module's tests run
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ, STEPS = 4096 + 77, 3  # ragged: padded to whole tiles by the handle


def _train(sparse: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    import transformers

    from lightning_mtraining import SparsityConfig, apply_context_parallel

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4099,
                                      max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    model = transformers.Qwen2ForCausalLM(config).cuda().bfloat16()
    sparsity = SparsityConfig(vertical_topk=256, slash_topk=8) if sparse else None
    handle = apply_context_parallel(model, None, sparsity=sparsity)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, config.vocab_size, (1, SEQ), generator=g).cuda()
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    handle.restore()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("sparse", [False, True])
def test_two_runs_are_bit_identical(sparse):
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        (la, pa), (lb, pb) = _train(sparse), _train(sparse)
    finally:
        torch.use_deterministic_algorithms(old)
    assert la == lb, (la, lb)
    for name, a in pa.items():
        assert torch.equal(a, pb[name]), f"{name} differs after {STEPS} steps (sparse={sparse})"
    assert len(set(la)) == STEPS  # it trained: the losses moved
