"""``torch.compile`` of a Hugging Face model under context parallelism: the same loss and gradients as eager.

The ring and the estimator are not yet custom ops: the compiler traces the model's own code and breaks the graph
where ring attention starts (collectives, host syncs), so each decoder layer compiles in pieces around it. What this
file guarantees is that compiling the whole model (``torch.compile(model)``, default options) is correct: dense and
sparse ring on 2 gloo ranks, against the same model run eagerly. CPU (inductor's C++ backend), float32, a tiny
Qwen2 at 192 tokens; about 3 minutes of CPU time per case, most of it compiling.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed

SEQ, VOCAB = 192, 64


def _model():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.3, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _sparsity(sparse: bool):
    from lightning_mtraining import SparsityConfig

    return SparsityConfig(vertical_topk=3, slash_topk=2, last_q=8, tile_size=16) if sparse else None


def _run(rank: int, world_size: int, sparse: bool, compiled: bool):
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel

    inductor_config.compile_threads = 1  # no compile worker pool per rank on a 2-core machine
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = _model()
    handle = apply_context_parallel(model, mesh, block_size=16, sparsity=_sparsity(sparse))
    fn = torch.compile(model) if compiled else model
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):  # the second call runs the compiled code without tracing again
        loss = fn(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        losses.append(float(loss.detach()))
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("world_size, sparse", [(2, False), (2, True)])
def test_compiled_model_matches_eager(world_size, sparse):
    def run(compiled):
        return run_distributed(_run, world_size, sparse, compiled, timeout=600)

    eager, compiled = run(False), run(True)
    for (want_losses, want_grads), (losses, grads) in zip(eager, compiled):
        # float32; inductor fuses and reorders the model's elementwise ops and reductions: ~1e-6 relative, and
        # the gradients accumulate two steps
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-5, (losses, want_losses)
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
