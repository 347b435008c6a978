"""Dense ring attention as a ``torch.library`` custom op, so that ``torch.compile`` sees one opaque op.

:func:`~lightning_mtraining.ring.attention.ring_attention` is Python around collectives, host-side decisions and an
``autograd.Function``: the compiler breaks the graph there. :func:`dense_ring_attention` computes the same thing
(the dense ring, with sliding windows, soft-caps and packed documents; the default block op) through two custom ops,
``mtraining::dense_ring_forward`` (``(out, lse)``) and ``mtraining::dense_ring_backward`` (``(dq, dk, dv)`` from the
final ``out`` and ``lse``), with fake implementations (shapes only) and the backward registered as the forward's
autograd formula. Process groups cannot be op arguments: they travel by name (``ProcessGroup.group_name``) and are
resolved inside the op. Everything else the ring decides per call (positions, block op, skipped steps) is
recomputed inside each op from those arguments (cached by shape, so a few dictionary lookups per layer).

Note [Ops under a dispatch mode]
--------------------------------
The first call of a compiled graph runs under AOTAutograd's ``_AnalyzeCustomOpInputOutputMode`` (a
``TorchDispatchMode`` that checks whether custom ops' outputs alias their inputs; ``torch._functorch.config.
check_custom_op_aliasing``). A mode hands each op to its ``__torch_dispatch__`` with every dispatch key above
``Python`` excluded in the thread-local state, functorch's (vmap) and ``ADInplaceOrView`` among them, and our op's
implementation runs inside that call. Everything it runs that needs those keys then fails. Seen: on CUDA (torch
2.11, an H100) the compiled dense op failed in FlexAttention's ``BlockMask.from_kv_blocks`` (a ``torch.vmap``):
"Cannot access storage of BatchedTensorImpl"; on CPU (torch 2.13) the same op with an uncompiled FlexAttention fails
under compile, and eagerly inside any pass-through dispatch mode, at the ``mask_mod``'s indexing (an
``autograd.Function`` under vmap): "could not find kernel for custom_function_call"; it passes with the check turned
off (``check_custom_op_aliasing = False``) or with :func:`outside_dispatch_mode`. That context restores the keys a
mode's call excluded (autograd and autocast stay excluded, as in any op implementation) for the op's body; every op of
this package runs its body under it (``tests/distributed/test_compile.py``: the CPU case, and the CUDA one on a GPU).

The estimator and the sparse ring are ops too: :mod:`lightning_mtraining.ring.sparse_op`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch._C import DispatchKey
from torch.library import custom_op, register_autograd

from lightning_mtraining.core.numerics import acc_dtype
from lightning_mtraining.core.topology import RingTopology, resolve_topology

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName
from lightning_mtraining.ring.setup import dense_setup
from lightning_mtraining.ring.walk import ring_backward, ring_forward

__all__ = ["dense_ring_attention", "group_by_name", "group_name", "outside_dispatch_mode", "topology_by_names"]

# Keys a TorchDispatchMode's call excludes (every key dispatched before Python), and those an op implementation
# excludes anyway (autograd and autocast: the state under ``_AutoDispatchBelowAutograd``, in which torch.library
# runs an op's implementation); computed once, at import, in a clean thread-local state.
_ABOVE_PYTHON = torch._C._dispatch_keyset_full() - torch._C._dispatch_keyset_full_after(DispatchKey.Python)
with torch._C._AutoDispatchBelowAutograd():
    _BELOW_AUTOGRAD = torch._C._dispatch_tls_local_exclude_set()


def outside_dispatch_mode() -> contextlib.AbstractContextManager:
    """A context in which an op implementation runs as it would outside any ``TorchDispatchMode`` (Note [Ops under a
    dispatch mode]); a no-op when no mode's call is under way."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    if not exclude.has(DispatchKey.FuncTorchDynamicLayerFrontMode):  # excluded only inside a mode's call
        return contextlib.nullcontext()
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           (exclude - _ABOVE_PYTHON) | (exclude & _BELOW_AUTOGRAD))


def group_name(group: dist.ProcessGroup | None) -> str:
    """How a process group travels through a custom op: its name ("" for the default group)."""
    return "" if group is None else group.group_name


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group :func:`group_name` named."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(cast("GroupName", name))


def topology_by_names(group: str, inner_group: str, outer_group: str) -> RingTopology:
    """The ring topology of groups passed by name."""
    return resolve_topology(group_by_name(group), group_by_name(inner_group), group_by_name(outer_group))


@custom_op("mtraining::dense_ring_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor | None, group: str,
                inner_group: str, outer_group: str, layout: str, block_size: int, scale: float | None,
                window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    with outside_dispatch_mode():
        topo = topology_by_names(group, inner_group, outer_group)
        d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start)
        (out, lse), _ = ring_forward(q, torch.stack([k, v]), topo, d.positions, d.op, d.scale, None, None, d.variant,
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
    with outside_dispatch_mode():
        topo = topology_by_names(group, inner_group, outer_group)
        d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start)
        dq, dk, dv = ring_backward(dout.contiguous(), q, torch.stack([k, v]), out, lse, topo, d.positions, d.op,
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
    """:func:`~lightning_mtraining.ring.attention.ring_attention` with ``sparsity=None`` and the default block op, as
    one custom op that ``torch.compile`` does not break (arguments as there). Differentiable in q, k and v."""
    out, _ = _forward_op(q, k, v, doc_start, group_name(group), group_name(inner_group), group_name(outer_group),
                         layout, block_size, scale, window, softcap)
    return out
