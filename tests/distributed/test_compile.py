"""``torch.compile`` of a Hugging Face model under context parallelism.

- A decoder layer compiles with ``fullgraph=True``, dense (full, sliding-window, packed documents) and sparse (top-k,
  top-p, packed documents, checkpointed): while compiling, the HF hook calls ``torch.library`` custom ops with fake
  implementations and registered autograd (:mod:`lightning_mtraining.ring.dense_op`,
  :mod:`lightning_mtraining.ring.sparse_op`); output and gradients equal eager, one pattern estimate per forward.
- The whole model compiled (``torch.compile(model, backend="aot_eager")``: Dynamo's capture with graph breaks allowed
  and AOTAutograd, without inductor's code generation, which the layer test runs) gives eager's losses and gradients.

2 gloo ranks, CPU (inductor's C++ backend for the layers), float32, a tiny Qwen2 at 192 tokens. Inductor's C++
compilation of the whole model cost about 1.5 minutes of a 2-core CI machine, hence aot_eager there.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.dist import run_distributed

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
    fn = torch.compile(model, backend="aot_eager") if compiled else model
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):  # the second call runs the compiled code without tracing again
        loss = fn(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        losses.append(float(loss.detach()))
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return losses, grads


# sparse only: a dense model's attention is the custom op, compiled whole in the fullgraph layer test below
@pytest.mark.parametrize("world_size, sparse", [(2, True)])
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


# Layer cases: (name, sliding window, packed documents, sparsity, checkpointed). Sparse: top-k and top-p (the estimate
# op's padded static widths), packed documents (its data-dependent vertical width), and a layer recomputed under
# activation checkpointing (the recompute must reuse the forward's pattern: Note [One pattern per forward]).
_TOPK = dict(vertical_topk=3, slash_topk=2, last_q=8, tile_size=16)
_TOPP = dict(top_p=0.6, max_vertical=5, max_slash=3, last_q=8, tile_size=16)
_W2_CASES = [
    ("dense", None, False, None, False),
    ("window", 40, False, None, False),
    ("dense packed", None, True, None, False),
    ("top-k", None, False, _TOPK, False),
    ("top-p checkpointed", None, False, _TOPP, True),
    ("top-k packed", None, True, _TOPK, False),
]
_W1_CASES = [("top-p checkpointed", None, False, _TOPP, True)]  # one rank: only sparse models are prepared
# Cases compiled through inductor (its C++ code generation); the others through aot_eager, which runs the same Dynamo
# capture (fullgraph: no graph break) and AOTAutograd, fake implementations and first-call checks included, at a
# fraction of the 2-core CI machine's time.
_INDUCTOR_CASES = ("dense", "top-k")


def _layer_worker(rank: int, world_size: int, cases: list):
    """For each case: one decoder layer, eager then compiled with ``fullgraph=True``, on this rank's shard."""
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    from lightning_mtraining import SparsityConfig, apply_context_parallel
    from lightning_mtraining.distributed.sharding import shard_batch
    from lightning_mtraining.ring import sparse_op as sparse_ring_op

    inductor_config.compile_threads = 1  # no compile worker pool per rank on a 2-core machine
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))

    def estimations(handle):  # patterns estimated: eager through the schedule, compiled through the estimate op
        return sparse_ring_op.estimations + (handle.schedule.estimations if handle.schedule is not None else 0)

    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    found = {}
    for name, window, packed, sparsity, checkpointed in cases:
        torch._dynamo.reset()
        model = _model()
        if window is not None:  # every layer a sliding-window layer
            model.config.sliding_window, model.config.layer_types = window, ["sliding_attention"] * 2
        handle = apply_context_parallel(model, mesh, block_size=16,
                                        sparsity=SparsityConfig(**sparsity) if sparsity else None)
        layer = model.model.layers[0]
        plan = layer.self_attn._mtraining_ring.plan
        batch = {"input_ids": x}
        if packed:  # three documents: the ops' doc_start input
            batch["position_ids"] = torch.cat([torch.arange(n) for n in (70, 50, SEQ - 120)])[None]
        plan.current = shard_batch(batch, cp_rank=rank, cp_size=world_size, layout="striped", block_size=16)
        pid = plan.current.doc_position_ids if packed else plan.current.position_ids
        hidden = model.model.embed_tokens(plan.current.batch["input_ids"]).detach()
        pos = model.model.rotary_emb(hidden, pid)
        results = []
        backend = "inductor" if name in _INDUCTOR_CASES else "aot_eager"
        for fn in (layer, torch.compile(layer, fullgraph=True, backend=backend)):  # fullgraph: a graph break fails
            for _ in range(2):  # the second call runs the compiled code without tracing (and without the first
                # call's custom-op aliasing check, Note [Ops under a dispatch mode] in
                # lightning_mtraining.ring.dense_op)
                plan.begin_forward(training=True)  # what the model's hook does before each forward
                before = estimations(handle)
                h = hidden.clone().requires_grad_(True)
                kw = dict(position_embeddings=pos, attention_mask=None, position_ids=pid)
                out = checkpoint(fn, h, use_reentrant=False, **kw) if checkpointed else fn(h, **kw)
                out = out[0] if isinstance(out, tuple) else out
                out.square().sum().backward()
                estimated = estimations(handle) - before
                results.append((out.detach(), h.grad, layer.self_attn.q_proj.weight.grad.clone(), estimated))
                layer.zero_grad()
        handle.restore()
        found[name] = results
    return found


def _check_layers(per_rank: list, cases: list) -> None:
    for found in per_rank:
        for name, _, _, sparsity, _ in cases:
            # against the second eager forward: from then on every forward runs the heads the one before decided
            # dense (the same batch: the same decision), compiled or not
            first, (out, dh, dw, n_est), *rest = found[name]
            assert first[3] == n_est
            for got_out, got_dh, got_dw, got_est in rest:
                # float32; inductor fuses and reorders the layer's own ops (norms, MLP): relative to the largest
                # value, ~1.5e-6 for this layer with transformers' own attention (same inputs, one process); the
                # ring ops run the same code compiled or not. 2e-5 leaves room
                for got, want in ((got_out, out), (got_dh, dh), (got_dw, dw)):
                    err = float((got - want).abs().max() / want.abs().max())
                    assert err < 2e-5, (name, err)
                # one estimate per sparse layer and forward, also when checkpointing recomputes the layer
                assert got_est == n_est == (1 if sparsity else 0), (name, got_est, n_est)


def test_decoder_layer_compiles_fullgraph():
    """A Hugging Face decoder layer under context parallelism compiles with ``fullgraph=True`` (its attention is
    custom ops: the dense ring, the estimator and the sparse ring) and gives eager's output and gradients: dense,
    sliding-window and packed documents, sparse top-k and top-p, with packed documents, and recomputed under
    activation checkpointing; 2 ranks, then the same path on one rank (compiled, a single rank uses the ops too)."""
    _check_layers(run_distributed(_layer_worker, 2, _W2_CASES, timeout=900), _W2_CASES)
    _check_layers(run_distributed(_layer_worker, 1, _W1_CASES, timeout=600), _W1_CASES)


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: every op runs inside its ``__torch_dispatch__``, as under AOTAutograd's
    first-call aliasing check (``_AnalyzeCustomOpInputOutputMode``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_ops_run_inside_a_dispatch_mode(monkeypatch):
    """Note [Ops under a dispatch mode] (ring_op): the dense ring op with FlexAttention (uncompiled, the CPU analogue
    of the CUDA failure under torch.compile) gives the same output inside a dispatch mode as outside; without
    ``outside_dispatch_mode`` the same call fails inside the mode."""
    import contextlib

    import lightning_mtraining.ring.dense_op as ring_op
    import lightning_mtraining.ring.setup as ring_setup
    from lightning_mtraining.ring.block_ops import FlexBlockOp

    flex = FlexBlockOp(tile=16, compile=False)  # CPU FlexAttention: forward only, no compiled kernel
    monkeypatch.setattr(ring_setup, "shared_block_op", lambda device: flex)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 48, 16, generator=g) for h in (4, 2, 2))
    want = ring_op.dense_ring_attention(q, k, v, block_size=16)
    with _PassThrough():
        got = ring_op.dense_ring_attention(q, k, v, block_size=16)
    # the same FlexAttention call on the same inputs: equal up to its own run-to-run rounding (none seen on CPU)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    monkeypatch.setattr(ring_op, "outside_dispatch_mode", contextlib.nullcontext)
    with pytest.raises((NotImplementedError, RuntimeError)), _PassThrough():  # vmap / autograd keys excluded
        ring_op.dense_ring_attention(q, k, v, block_size=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention and the Triton kernels)")
@pytest.mark.parametrize("packed", [False, True])
def test_ring_ops_compile_on_cuda(packed):
    """On one CUDA device (no process group), ``torch.compile(fullgraph=True)`` of the dense ring op (FlexAttention:
    its first compiled call used to fail in ``BlockMask.from_kv_blocks``, "Cannot access storage of BatchedTensorImpl",
    Note [Ops under a dispatch mode] in lightning_mtraining.ring.dense_op), and of the estimate and sparse ring ops (the
    Triton kernels; packed documents: the torch op), forward and backward, equal the same ops run eagerly."""
    from lightning_mtraining import SparsityConfig
    from lightning_mtraining.core.layouts import document_starts
    from lightning_mtraining.ring.dense_op import dense_ring_attention
    from lightning_mtraining.ring.sparse_op import estimate_pattern_op, sparse_ring_attention

    torch._dynamo.reset()
    S, dev = 4096, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, S, 64, device=dev, dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    doc = None
    if packed:
        doc = document_starts(torch.cat([torch.arange(n) for n in (1500, 1000, S - 2500)])[None].to(dev))
    sparsity = SparsityConfig(vertical_topk=64, slash_topk=32)

    def step(q, k, v):
        dense = dense_ring_attention(q, k, v, doc_start=doc)
        vertical, slash = estimate_pattern_op(q, k, sparsity, doc_start=doc)
        sparse = sparse_ring_attention(q, k, v, vertical, slash, tile_size=sparsity.tile_size, doc_start=doc)
        return dense, sparse

    results = []
    for fn in (step, torch.compile(step, fullgraph=True), torch.compile(step, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        dense, sparse = fn(*leaves)
        (dense.float().square().sum() + sparse.float().square().sum()).backward()
        results.append([dense.detach(), sparse.detach()] + [t.grad for t in leaves])
    for compiled in results[1:]:  # the first compiled call (under the aliasing check's mode) and a later one
        for got, want in zip(compiled, results[0]):
            # the same kernels on the same inputs, compiled or not: any difference is a different code path, not
            # rounding; bf16 tolerances of torch.testing cover FlexAttention's own run-to-run order (atomics in its
            # backward)
            torch.testing.assert_close(got, want)


def test_compile_option_compiles_each_decoder_layer():
    """``MTrainingStrategy(compile=...)`` compiles each decoder layer in place once the models are prepared
    (``hf.compile_decoder_layers``; module names and parameters unchanged), and the compiled sparse model gives the
    loss and gradients of the same model eager; one process, AOTAutograd without inductor (the layer test above
    covers inductor)."""
    from lightning_mtraining import MTrainingStrategy, SparsityConfig, apply_context_parallel
    from lightning_mtraining.distributed.plan import ContextParallelPlan
    from lightning_mtraining.hf.model import decoder_layers

    torch._dynamo.reset()
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    strategy = MTrainingStrategy(sparsity=SparsityConfig(**_TOPK), block_size=16,
                                 compile={"backend": "aot_eager", "fullgraph": True})
    strategy._plan = ContextParallelPlan(block_size=16)  # what setup_distributed builds at world size 1
    results = []
    for compiled in (False, True):
        model = _model()
        names = [n for n, _ in model.named_parameters()]
        if compiled:
            strategy.prepare_models(model)
            handle = strategy._cp
            layers = decoder_layers(model)
            assert layers == list(model.model.layers)
            assert all(layer._compiled_call_impl is not None for layer in layers)
            assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod wrapper
        else:
            handle = apply_context_parallel(model, None, block_size=16, sparsity=SparsityConfig(**_TOPK))
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, grads) = results
    # float32, AOTAutograd runs the same aten ops as eager (no fusion): differences are the decomposition's rounding
    assert abs(got - want) < 1e-5, (got, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
