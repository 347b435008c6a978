"""``losses.fused_linear_cross_entropy`` against the plain loss (logits materialised) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mtraining.hf.losses import fused_linear_cross_entropy


def plain(h, w, t, b=None, scale=1.0, softcap=None):
    z = F.linear(h, w, b) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.reshape(-1, w.shape[0]), t.reshape(-1), reduction="sum", ignore_index=-100)


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


CASES = [  # (leading shape, D, V, chunk, bias, scale, softcap, ignored)
    ((3, 37), 16, 1013, 7, False, 1.0, None, "some"),
    ((3, 37), 16, 1013, 1, True, 1.0, None, "some"),
    ((111,), 8, 257, 500, True, 0.25, None, "none"),
    ((2, 50), 12, 129, 16, False, 1.0, 3.0, "chunk"),
    ((2, 50), 12, 129, 16, True, 4.0, 2.0, "all"),
    ((5, 9), 8, 33, None, False, 1.0, None, "some"),
]


@pytest.mark.parametrize("lead,D,V,chunk,use_bias,scale,softcap,ignored", CASES)
def test_equals_the_plain_loss_and_gradients(lead, D, V, chunk, use_bias, scale, softcap, ignored):
    g = torch.Generator().manual_seed(V + D)
    h = torch.randn(*lead, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if use_bias else None
    t = torch.randint(0, V, lead, generator=g)
    flat = t.view(-1)
    if ignored == "some":
        flat[::5] = -100
    elif ignored == "chunk":  # the whole first chunk of 16 rows, and more
        flat[:20] = -100
    elif ignored == "all":
        flat[:] = -100
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    want = plain(h1, w1, t, b1, scale, softcap)
    got = fused_linear_cross_entropy(h2, w2, t, b2, logit_scale=scale, softcap=softcap, chunk_size=chunk)
    assert got.dtype == torch.float64
    # float64: the same sums regrouped by chunk, so agreement to ~1e-12 relative
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (2.5 * want).backward()
    (2.5 * got).backward()  # a non-unit incoming gradient is applied
    for a, c in ((h1, h2), (w1, w2), (b1, b2)):
        if a is not None:
            torch.testing.assert_close(c.grad, a.grad, rtol=1e-10, atol=1e-12)
    if ignored == "all":
        assert float(got.detach()) == 0.0 and not h2.grad.any() and not w2.grad.any()


def test_tied_weight_gradients_add_up():
    """The same parameter as input embedding and output head: both uses' gradients reach it."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(61, 8, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 61, (4, 10), generator=g)
    t = torch.randint(0, 61, (4, 10), generator=g)
    grads = []
    for fn in (lambda h, w: plain(h, w, t), lambda h, w: fused_linear_cross_entropy(h, w, t, chunk_size=3)):
        w = emb.clone().requires_grad_(True)
        h = torch.tanh(F.embedding(ids, w) * 1.3)
        fn(h, w).backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)  # float64, as above


def test_bfloat16_against_a_float32_reference():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(509, 64, generator=g) * 0.2
    t = torch.randint(0, 509, (300,), generator=g)
    h32, w32 = leaves(h, w)
    ref = plain(h32, w32, t)
    ref.backward()
    hb, wb = leaves(h.bfloat16(), w.bfloat16())
    got = fused_linear_cross_entropy(hb, wb, t, chunk_size=64)
    got.backward()
    assert got.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    # bf16 inputs and matmuls (8-bit mantissa, relative rounding 2^-8 = 0.4%) against float32: the logits carry
    # ~0.4% error, the summed loss far less (errors average out); 1% on the loss and 4% of the largest gradient
    # entry bound the rounding of the inputs and of the gradient matmuls
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=0)
    assert (hb.grad.float() - h32.grad).abs().max() < 0.04 * h32.grad.abs().max()
    assert (wb.grad.float() - w32.grad).abs().max() < 0.04 * w32.grad.abs().max()


def test_no_grad_computes_only_the_loss():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(40, 8, generator=g, requires_grad=True)
    w = torch.randn(97, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 97, (40,), generator=g)
    with torch.no_grad():
        value = fused_linear_cross_entropy(h, w, t, chunk_size=9)
    assert value.grad_fn is None
    torch.testing.assert_close(value, plain(h, w, t).detach(), rtol=1e-6, atol=1e-6)  # float32 regrouped sums
    out = fused_linear_cross_entropy(h.detach(), w.detach(), t)
    assert out.grad_fn is None  # nothing requires grad: no gradients were computed or saved


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 7), targets=torch.zeros(4, dtype=torch.long)),
     r"hidden \(4, 8\) and weight \(10, 7\) do not match"),
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.zeros(5, dtype=torch.long)),
     r"targets \(5,\) do not line up with hidden \(4, 8\)"),
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.zeros(4)),
     r"targets must be integer token ids, got torch.float32"),
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.zeros(4, dtype=torch.long),
          bias=torch.randn(9)), r"bias \(9,\) must be \[10\]"),
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.zeros(4, dtype=torch.long),
          chunk_size=0), r"chunk_size must be at least 1, got 0"),
    (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.zeros(4, dtype=torch.long),
          softcap=0.0), r"softcap must be positive or None, got 0.0"),
])
def test_bad_inputs_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(**kwargs)


def _liger_installed() -> bool:
    from lightning_mtraining.hf.losses import _liger_function

    return not isinstance(_liger_function(), str)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,softcap,use_bias", [("torch", None, False), ("auto", None, False),
                                                       ("liger", None, False), ("liger", 30.0, True)])
def test_gpu_bf16_qwen_vocabulary(backend, softcap, use_bias):
    """Real sizes on the GPU: 4096 rows, Qwen2's 151936-token vocabulary, bf16, against float32 on the GPU; each
    backend ("auto" is Liger-Kernel where installed, else the torch path), with a soft-cap and a bias for Liger."""
    if backend == "liger" and not _liger_installed():
        pytest.skip("liger_kernel is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 512, device="cuda", generator=g)
    w = torch.randn(151936, 512, device="cuda", generator=g) * 0.05
    b = torch.randn(151936, device="cuda", generator=g) * 0.1 if use_bias else None
    t = torch.randint(0, 151936, (4096,), device="cuda", generator=g)
    t[::7] = -100
    h32, w32, b32 = leaves(h, w, b)
    ref = plain(h32, w32, t, b32, softcap=softcap)
    ref.backward()
    hb, wb, bb = leaves(h.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16())
    got = fused_linear_cross_entropy(hb, wb, t, bb, softcap=softcap, backend=backend)
    got.backward()
    # the bf16 rule of the CPU test above
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=0)
    assert (hb.grad.float() - h32.grad).abs().max() < 0.04 * h32.grad.abs().max()
    assert (wb.grad.float() - w32.grad).abs().max() < 0.04 * w32.grad.abs().max()
    if use_bias:
        assert (bb.grad.float() - b32.grad).abs().max() < 0.04 * b32.grad.abs().max()


def test_backend_auto_on_cpu_is_the_torch_path_and_bad_backends_are_refused():
    """"auto" on CPU computes exactly what "torch" does (Liger-Kernel needs CUDA); "liger" says why it cannot run;
    an unknown backend names the known ones."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(40, 8, generator=g), torch.randn(37, 8, generator=g)
    t = torch.randint(0, 37, (40,), generator=g)
    ha, wa = leaves(h, w)
    ht, wt = leaves(h, w)
    auto = fused_linear_cross_entropy(ha, wa, t)
    torch_path = fused_linear_cross_entropy(ht, wt, t, backend="torch")
    auto.backward()
    torch_path.backward()
    assert torch.equal(auto, torch_path) and torch.equal(ha.grad, ht.grad) and torch.equal(wa.grad, wt.grad)
    with pytest.raises(ValueError, match=r"backend='liger'\): the inputs are on cpu, Liger-Kernel's kernels need CUDA"):
        fused_linear_cross_entropy(h.requires_grad_(), w, t, backend="liger")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'liger'\), got 'cce'"):
        fused_linear_cross_entropy(h, w, t, backend="cce")


def test_liger_obstacles_name_the_condition():
    """Each condition under which "auto" keeps the torch path is named (checked on CPU tensors past the device)."""
    from lightning_mtraining.hf.losses import _liger_obstacle

    h = torch.randn(4, 8)
    w = torch.randn(10, 8)
    assert "need CUDA" in _liger_obstacle(h, w, 1.0, (True, True, False))
    meta_h, meta_w = h.to("meta"), w.to("meta")  # past the device check only with a CUDA-like device: patch it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert "logit_scale=0.5" in _liger_obstacle(meta_h, meta_w, 0.5, (True, True, False))
        assert "float64" in _liger_obstacle(meta_h.double(), meta_w.double(), 1.0, (True, True, False))
        assert "no gradient is needed" in _liger_obstacle(meta_h, meta_w, 1.0, (False, True, False))


# ---- products per chunk, bf16 error against torch's own, autocast, layouts and empty inputs ----

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.matmul, torch.ops.aten.linear}


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products that reach the kernels (after autograd and composite decompositions)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def test_matmuls_per_chunk_and_no_gradients_without_grad_mode():
    """Per chunk: logits, then d hidden and d weight only for inputs that need them; backward only scales. Under
    no_grad (evaluation) one product per chunk, so no gradient is computed there, not only not returned."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(40, 8, generator=g, requires_grad=True)
    w = torch.randn(97, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 97, (40,), generator=g)
    chunks = 5  # 40 rows in chunks of 8
    cases = [  # (hidden, weight, grad mode, products per chunk)
        (h, w, torch.enable_grad(), 3), (h, w.detach(), torch.enable_grad(), 2),
        (h.detach(), w, torch.enable_grad(), 2), (h.detach(), w.detach(), torch.enable_grad(), 1),
        (h, w, torch.no_grad(), 1),
    ]
    for hh, ww, mode, per_chunk in cases:
        with mode, CountMatmuls() as counter:
            fused_linear_cross_entropy(hh, ww, t, chunk_size=8)
        assert counter.count == per_chunk * chunks, (hh.requires_grad, ww.requires_grad, per_chunk, counter.count)
    out = fused_linear_cross_entropy(h, w, t, chunk_size=8)
    with CountMatmuls() as counter:
        out.backward()
    assert counter.count == 0 and h.grad is not None and w.grad is not None


def hf_plain(h, w, t):
    """Hugging Face's order: logits in the inputs' dtype, upcast to float32 for the loss."""
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum", ignore_index=-100)


def errors_against(ref, fn, h, w, dtype):
    """Max abs errors of (loss, d hidden, d weight) of ``fn`` on ``h, w`` cast to ``dtype``, against ``ref``."""
    hh, ww = (x.to(dtype).detach().clone().requires_grad_(True) for x in (h, w))
    loss = fn(hh, ww)
    loss.backward()
    got = (loss.detach().double(), hh.grad.double(), ww.grad.double())
    return [float((a - b).abs().max()) for a, b in zip(got, ref)]


@pytest.mark.parametrize("autocast", [False, True])
def test_bfloat16_error_at_most_twice_torchs(autocast):
    """bf16 (or float32 under CPU autocast to bf16) over 64 chunks against a float32 reference from the same
    bf16-rounded inputs: each error at most twice that of the plain loss at the same precision (flash-attention's
    rule). Measured ratios are 1.0-1.4; summing d weight over the chunks in bf16 instead of float32 gives 3.5-4.2,
    which a fixed tolerance on the gradient's size does not catch."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(1024, 64, generator=g).bfloat16()
    w = (0.3 * torch.randn(1013, 64, generator=g)).bfloat16()
    t = torch.randint(0, 1013, (1024,), generator=g)
    t[::11] = -100
    h32, w32 = leaves(h.float(), w.float())
    ref_loss = hf_plain(h32, w32, t)
    ref_loss.backward()
    ref = (ref_loss.detach().double(), h32.grad.double(), w32.grad.double())
    dtype = torch.float32 if autocast else torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain_err = errors_against(ref, lambda a, b: hf_plain(a, b, t), h, w, dtype)
        ours_err = errors_against(ref, lambda a, b: fused_linear_cross_entropy(a, b, t, chunk_size=16), h, w, dtype)
    assert min(plain_err) > 0  # the plain loss did run in bf16: the rule below compares real errors
    for name, ours, plain_e in zip(("loss", "grad_hidden", "grad_weight"), ours_err, plain_err):
        assert ours <= 2 * plain_e, (name, ours, plain_e)


def test_non_floating_hidden_is_refused():
    with pytest.raises(ValueError, match=r"floating point, got torch.int64"):
        fused_linear_cross_entropy(torch.ones(4, 8, dtype=torch.long), torch.randn(10, 8),
                                   torch.zeros(4, dtype=torch.long))


def test_non_contiguous_hidden_and_no_rows():
    """A transposed ``[B, L, D]`` view (as from a ``[L, B, D]`` model) and an empty batch, in float64 (so to
    ~1e-12, the sums being only regrouped)."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(8, 5, 16, generator=g, dtype=torch.float64).transpose(0, 1)
    w = torch.randn(33, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 33, (5, 8), generator=g)
    h1, w1 = leaves(h, w)
    h2, w2 = leaves(h, w)
    want, got = plain(h1, w1, t), fused_linear_cross_entropy(h2, w2, t, chunk_size=3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.backward()
    got.backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-10, atol=1e-12)
    empty, w3 = leaves(torch.randn(0, 16, dtype=torch.float64), w)
    out = fused_linear_cross_entropy(empty, w3, torch.zeros(0, dtype=torch.long))
    out.backward()
    assert float(out.detach()) == 0.0 and empty.grad.shape == (0, 16) and not w3.grad.any()
