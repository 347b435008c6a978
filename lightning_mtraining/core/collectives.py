"""Small collective helpers shared by the core (pattern estimation, ring attention), across torch versions.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); torch 2.11 has only the old names. Gloo takes the gathered output
only concatenated along dim 0 (``[W * d0, ...]``), not stacked (``[W, d0, ...]``), so both helpers use that form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_mtraining.core.errors import entering_collective, who_did_not_arrive

__all__ = ["all_gather_stacked", "named_failure", "reduce_scatter_dim0"]


@contextlib.contextmanager
def named_failure(what: str) -> Iterator[None]:
    """Count the collective this rank enters (Note [Who did not arrive] in :mod:`lightning_mtraining.core.errors`),
    and re-raise it, failed or timed out, with what it was, which rank waited and which ranks did not arrive.

    Gloo raises ``Timed out waiting 1800000ms for recv operation to complete`` after the process group's timeout,
    naming neither the operation nor the peer; this adds both, and the ranks that had not reached it (with the
    collective and step each was at) where the job's failure watch runs. (NCCL's watchdog aborts the process itself
    after the timeout, naming the operation's type and sequence number.)
    """
    count = entering_collective(what)
    try:
        yield
    except RuntimeError as err:
        rank = dist.get_rank() if dist.is_initialized() else 0
        missing = who_did_not_arrive(count, what)
        raise RuntimeError(
            f"rank {rank}: {what} failed" + (f" ({missing})" if missing else "") + f": {err}. A rank it waits on "
            "died, stalled or ran different work; the wait is bounded by the process group's timeout "
            "(MTrainingStrategy(timeout=...), init_process_group(timeout=...))"
        ) from err

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_stacked(t: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """``[size, *t.shape]``: every rank's ``t`` in rank order (``t[None]`` when ``size == 1``)."""
    if size == 1:
        return t[None]
    t = t.contiguous()
    out = torch.empty((size * t.shape[0], *t.shape[1:]) if t.dim() else (size,), dtype=t.dtype, device=t.device)
    with named_failure(f"all-gather of {tuple(t.shape)} over a group of {size}"):
        _ALL_GATHER(out, t if t.dim() else t[None], group=group)
    return out.view(size, *t.shape)


def reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Sum ``t [size, ...]`` over the ranks and return this rank's row ``[...]`` of the sum."""
    if size == 1:
        return t[0]
    t = t.contiguous()
    out = torch.empty((t.shape[1] if t.dim() > 1 else 1, *t.shape[2:]), dtype=t.dtype, device=t.device)
    with named_failure(f"reduce-scatter of {tuple(t.shape)} over a group of {size}"):
        _REDUCE_SCATTER(out, t.view(size * out.shape[0], *t.shape[2:]) if t.dim() > 1 else t, group=group)
    return out if t.dim() > 1 else out[0]
