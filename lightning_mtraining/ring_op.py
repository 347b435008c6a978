"""Dense ring attention as a ``torch.library`` custom op, so that ``torch.compile`` sees one opaque op.

:func:`~lightning_mtraining.ring.ring_attention` is Python around collectives, host-side decisions and an
``autograd.Function``: the compiler breaks the graph there. :func:`dense_ring_attention` computes the same thing
(the dense ring, with sliding windows, soft-caps and packed documents; the default block op) through two custom ops,
``mtraining::dense_ring_forward`` (``(out, lse)``) and ``mtraining::dense_ring_backward`` (``(dq, dk, dv)`` from the
final ``out`` and ``lse``), with fake implementations (shapes only) and the backward registered as the forward's
autograd formula. Process groups cannot be op arguments: they travel by name (``ProcessGroup.group_name``) and are
resolved inside the op. Everything else the ring decides per call (positions, block op, skipped steps) is
recomputed inside each op from those arguments (cached by shape, so a few dictionary lookups per layer).

Known limit: on CUDA (torch 2.11, an H100) the op runs eagerly, but under ``torch.compile`` its FlexAttention block
op fails while building the BlockMask ("Cannot access storage of BatchedTensorImpl" in ``BlockMask.from_kv_blocks``);
compiling with the op is tested on CPU only.

The sparse ring is not an op yet (its per-step lists, built from the forward's pattern, would have to be rebuilt
in the backward or returned as tensors), so sparse layers still break the graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.library import custom_op, register_autograd

from lightning_mtraining.attention_ops import acc_dtype
from lightning_mtraining.ring import (
    RingTopology,
    _ring_backward,
    _ring_forward,
    dense_setup,
    resolve_topology,
)

__all__ = ["dense_ring_attention"]


def _name(group: dist.ProcessGroup | None) -> str:
    return "" if group is None else group.group_name


def _group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _topology(group: str, inner_group: str, outer_group: str) -> RingTopology:
    return resolve_topology(_group(group), _group(inner_group), _group(outer_group))


@custom_op("mtraining::dense_ring_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor | None, group: str,
                inner_group: str, outer_group: str, layout: str, block_size: int, scale: float | None,
                window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    topo = _topology(group, inner_group, outer_group)
    d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start)
    (out, lse), _ = _ring_forward(q, torch.stack([k, v]), topo, d.positions, d.op, d.scale, None, None, d.variant,
                                  d.skips)
    return out.to(q.dtype).contiguous(), lse.to(acc_dtype(q.dtype)).contiguous()


@_forward_op.register_fake
def _(q, k, v, doc_start, group, inner_group, outer_group, layout, block_size, scale, window, softcap):
    # contiguous, as the real outputs are (q itself is often a transposed view)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@custom_op("mtraining::dense_ring_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, doc_start: torch.Tensor | None, group: str, inner_group: str, outer_group: str,
                 layout: str, block_size: int, scale: float | None, window: int | None,
                 softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    topo = _topology(group, inner_group, outer_group)
    d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start)
    dq, dk, dv = _ring_backward(dout.contiguous(), q, torch.stack([k, v]), out, lse, topo, d.positions, d.op,
                                d.scale, None, d.variant, d.skips)
    # dk and dv are views of one buffer: an op's outputs may not alias each other (a copy where the dtype is kept)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype, copy=True).contiguous(), dv.to(v.dtype, copy=True).contiguous()


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, doc_start, group, inner_group, outer_group, layout, block_size, scale, window,
      softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, doc_start, *config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.doc_start, ctx.config = doc_start, config


def _backward(ctx, dout, dlse):
    # dlse is not used: the op's callers take ``out`` only (the lse output is for the backward)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, ctx.doc_start, *ctx.config)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


register_autograd(_forward_op, _backward, setup_context=_setup_context)


def dense_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~lightning_mtraining.ring.ring_attention` with ``sparsity=None`` and the default block op, as one custom
    op that ``torch.compile`` does not break (arguments as there). Differentiable in q, k and v."""
    out, _ = _forward_op(q, k, v, doc_start, _name(group), _name(inner_group), _name(outer_group), layout,
                         block_size, scale, window, softcap)
    return out
