"""The machine's fused dense attention as a block op, for the ring steps whose mask it expresses.

Shape legend: B batch, H query heads, Hkv key/value heads (G = H // Hkv query heads per KV head), S the block's
length, D head dim.

Which steps: a ring step whose queries and keys are the same rank's chunk (step 0 of every ring, and the single step
of a ring of one rank) computes plain causal attention in *local* order. Positions increase within a shard, so key
j is visible to query i iff ``j <= i``; no mask tensor is needed, and the fastest dense kernels take exactly that
case (``is_causal``). Every other step of a striped ring sees the other rank's keys through a staircase at block
granularity, which these kernels do not express, and sliding windows, soft-caps and packed documents need a mask too:
those go to the fallback op (FlexAttention on CUDA, the chunked torch op elsewhere).

Which kernels:

- one rank (:meth:`FusedDenseOp.differentiable`): ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
  is_causal=True, enable_gqa=...)`` with torch's own autograd: the call Hugging Face's ``"sdpa"`` attention makes,
  so a dense layer under the sparse strategy costs what it costs under ``strategy="mtraining_dense"``;
- inside a ring (:meth:`FusedDenseOp.forward` / :meth:`FusedDenseOp.backward`): the ring merges partial results by
  log-sum-exp, so the kernel must return it and its backward must take the merged output and log-sum-exp. On CUDA,
  cuDNN's attention (``aten._scaled_dot_product_cudnn_attention`` with ``compute_log_sumexp=True`` and its
  backward; bf16/fp16); on CPU, ATen's flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward, float32/float64/bf16/fp16).

cuDNN's private entry points are checked once per (device, dtype, heads, head dim) on a small random problem against
a float32 reference (:func:`_cudnn_works`); where the check fails (an older cuDNN, a head dim it does not take, a
changed signature) the op warns once and uses the fallback. Which of cuDNN and FlexAttention is faster per block is
measured by ``benchmarks/gpu_gate.py`` (RESULTS "GPU gate").
"""

from __future__ import annotations

import math
import warnings

import torch

from lightning_mtraining.core.numerics import acc_dtype

__all__ = ["FusedDenseOp"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDNN_DTYPES = (torch.bfloat16, torch.float16)

# (device index, dtype, H, Hkv, D) -> (philox seed, philox offset) of a working cuDNN call, or None where it failed
_CUDNN_CHECKED: dict[tuple, tuple | None] = {}
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, H, S, D]`` (query head h reads KV head h // groups)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse for gradients: ``[B, H, S, D] -> [B, Hkv, S, D]``, summed over each KV head's query heads."""
    if groups == 1:
        return t
    B, H, S, D = t.shape
    return t.view(B, H // groups, groups, S, D).sum(2)


def _cudnn_forward(q, k, v, scale: float):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    return res[0], res[1], res[6], res[7]


def _cudnn_backward(dout, q, k, v, out, lse_raw, philox, scale: float):
    Sq, Sk = q.shape[2], k.shape[2]
    # cum_seq_q / cum_seq_k None: undefined tensors, the dense (not nested) path, as the forward returns them
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse_raw, philox[0], philox[1], None, None, None, Sq, Sk, 0.0, True, scale=scale)


def _cudnn_works(device: torch.device, dtype: torch.dtype, H: int, Hkv: int, D: int) -> tuple | None:
    """Whether cuDNN's attention with log-sum-exp runs and is right here, checked once on a 256-token random problem
    against a float32 reference (out, lse and the three gradients within bf16/fp16 rounding); the philox tensors its
    backward takes, or None."""
    key = (device.index, dtype, H, Hkv, D)
    if key in _CUDNN_CHECKED:
        return _CUDNN_CHECKED[key]
    found = None
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        S, scale = 256, 1 / math.sqrt(D)
        q, k, v = (torch.randn(1, h, S, D, device=device, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
        dout = torch.randn(1, H, S, D, device=device, generator=gen).to(dtype)
        G = H // Hkv
        out, lse, seed, offset = _cudnn_forward(q, _expand_kv(k, G), _expand_kv(v, G), scale)
        dq, dk, dv = _cudnn_backward(dout, q, _expand_kv(k, G), _expand_kv(v, G), out, lse, (seed, offset), scale)
        # the float32 reference and its gradients by the softmax backward's formulas, not autograd: this check can
        # run inside a custom op's implementation (the compiled dense ring), where autograd is excluded
        qf, kf, vf, dof = q.float(), _expand_kv(k, G).float(), _expand_kv(v, G).float(), dout.float()
        s = (qf @ kf.transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=device).triu(1), float("-inf"))
        p = torch.softmax(s, -1)
        ref_out = p @ vf
        dp = dof @ vf.transpose(-1, -2)
        ds = p * (dp - (dof * ref_out).sum(-1, keepdim=True))
        refs = (ref_out, ds @ kf * scale, _fold_kv(ds.transpose(-1, -2) @ qf * scale, G),
                _fold_kv(p.transpose(-1, -2) @ dof, G))
        got = (out, dq, _fold_kv(dk.float(), G), _fold_kv(dv.float(), G))
        ok = all(float((a.float() - b).norm() / b.norm()) < 3e-2 for a, b in zip(got, refs))
        ok = ok and float((lse.float().reshape(1, H, S) - torch.logsumexp(s, -1)).abs().max()) < 2e-2
        found = (seed, offset) if ok else None
        if not ok:
            _warn_once(f"cudnn-wrong-{key}", f"cuDNN attention with log-sum-exp gave wrong results for {dtype}, "
                       f"{H} query / {Hkv} KV heads of dim {D} on {device}: the ring's own-chunk steps use "
                       "FlexAttention there instead")
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as err:
        _warn_once(f"cudnn-fail-{key}", f"cuDNN attention with log-sum-exp is not available for {dtype}, {H} query / "
                   f"{Hkv} KV heads of dim {D} on {device} ({type(err).__name__}: {str(err).splitlines()[0][:200]}): "
                   "the ring's own-chunk steps use FlexAttention there instead")
    _CUDNN_CHECKED[key] = found
    return found


def _plain(variant: dict) -> bool:
    return not any(value is not None for value in variant.values())


class FusedDenseOp:
    """Block op: the fused causal kernel on the blocks of a rank's own chunk (``q_pos is k_pos``, no window,
    soft-cap or documents), ``fallback`` on every other block (see the module docstring).

    Args:
        fallback: the op for the other blocks (it also declares which variants this op computes).
        kernel: "auto" (the fused kernel where it runs: cuDNN on CUDA for bf16/fp16 after its one-time check, ATen's
            flash kernel on CPU), or "fallback" (always ``fallback``: the FlexAttention-only ring, for comparison).
    """

    def __init__(self, fallback, kernel: str = "auto") -> None:
        if kernel not in ("auto", "fallback"):
            raise ValueError(f"FusedDenseOp(kernel={kernel!r}): expected 'auto' or 'fallback'")
        self.fallback = fallback
        self.kernel = kernel
        for attr in ("supports_window", "supports_softcap", "supports_documents"):
            setattr(self, attr, getattr(fallback, attr, False))

    def fused_kernel(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """Which fused kernel a plain causal block of these inputs runs: "cudnn", "cpu_flash" or None (fallback)."""
        if self.kernel == "fallback":
            return None
        if q.device.type == "cpu":
            return "cpu_flash" if q.dtype in _CPU_DTYPES else None
        if q.device.type == "cuda" and q.dtype in _CUDNN_DTYPES and torch.backends.cudnn.is_available():
            philox = _cudnn_works(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1])
            return "cudnn" if philox is not None else None
        return None

    def _own_block(self, q, k, q_pos, k_pos, variant) -> str | None:
        if q_pos is not k_pos or not _plain(variant) or q.shape[2] != k.shape[2]:
            return None
        return self.fused_kernel(q, k)

    def forward(self, q, k, v, q_pos, k_pos, scale, **variant):
        which = self._own_block(q, k, q_pos, k_pos, variant)
        if which is None:
            return self.fallback.forward(q, k, v, q_pos, k_pos, scale, **variant)
        B, H, S, _ = q.shape
        if which == "cpu_flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None,
                                                                                   scale=scale)
            return out, lse.to(acc_dtype(q.dtype))
        G = H // k.shape[1]
        out, lse, _, _ = _cudnn_forward(q.contiguous(), _expand_kv(k, G).contiguous(), _expand_kv(v, G).contiguous(),
                                        scale)
        return out, lse.float().reshape(B, H, S)

    def backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale, **variant):
        which = self._own_block(q, k, q_pos, k_pos, variant)
        if which is None:
            return self.fallback.backward(q, k, v, out, lse, dout, q_pos, k_pos, scale, **variant)
        adt = acc_dtype(q.dtype)
        out = out.to(q.dtype).contiguous()
        dout = dout.to(q.dtype).contiguous()
        if which == "cpu_flash":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype).contiguous(), 0.0,
                True, attn_mask=None, scale=scale)
            return dq.to(adt), dk.to(adt), dv.to(adt)
        B, H, S, _ = q.shape
        G = H // k.shape[1]
        philox = _CUDNN_CHECKED[(q.device.index, q.dtype, H, k.shape[1], q.shape[-1])]
        dq, dk, dv = _cudnn_backward(dout, q.contiguous(), _expand_kv(k, G).contiguous(),
                                     _expand_kv(v, G).contiguous(), out, lse.float().reshape(B, H, S, 1).contiguous(),
                                     philox, scale)
        return dq.float(), _fold_kv(dk.float(), G), _fold_kv(dv.float(), G)

    def differentiable(self, q, k, v, q_pos, k_pos, scale, **variant) -> torch.Tensor | None:
        """A ring of one rank: plain causal attention through ``scaled_dot_product_attention`` and torch's autograd
        (the call Hugging Face's "sdpa" attention makes), or the fallback's own autograd for a masked variant; None
        where the fallback has none (the caller then runs the ring's own autograd function)."""
        if q_pos is k_pos and _plain(variant) and self.kernel != "fallback":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
        if hasattr(self.fallback, "differentiable"):
            return self.fallback.differentiable(q, k, v, q_pos, k_pos, scale, **variant)
        return None

    def __repr__(self) -> str:
        return f"FusedDenseOp({self.fallback!r}, kernel={self.kernel!r})"
