"""Per-block attention ops: what one ring step computes, and the log-sum-exp merge of partial results.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, G = H // Hkv query heads share one KV
head: query head h reads KV head h // G), Sq / Sk query / key lengths of the block, D head dim.

An op computes causal attention of a block of queries against a block of keys, where causality is decided by
*global token positions*: query i may see key j iff ``k_pos[j] <= q_pos[i]``. Positions are increasing within
each block (true for every layout in :mod:`lightning_mtraining.core.layouts`), so a tile of queries either sees a tile
of keys fully, partially (only then is a token-level mask needed) or not at all (never computed).

Protocol (duck-typed; the ring and the simulated ring call only these two methods):

``forward(q, k, v, q_pos, k_pos, scale) -> (out [B,H,Sq,D] in q.dtype, lse [B,H,Sq])``
    lse is float32 (float64 for float64 inputs, so references stay float64 end to end). Rows with no visible
    key return out 0 and lse -inf.
``backward(q, k, v, out, lse, dout, q_pos, k_pos, scale) -> (dq, dk, dv)``
    Flash-attention-style backward given the *final* (merged over all blocks) ``out`` and ``lse``: the returned
    gradients are this block's contributions (float32, or float64 for float64 inputs), to be summed over blocks.

An op with ``supports_running = True`` (the Triton kernels' op) also takes ``forward(..., out=, lse=)``: the running
result of the earlier ring steps (float accumulators), into which it merges the block by log-sum-exp in place, in its
kernel, and returns; the ring then needs no merge of its own (:func:`merge_attention`, for the other ops).

Sparse ops (attribute ``supports_tiles = True``) also take ``tiles=`` (a
:class:`~mtraining_kernels.indexing.TileLists` of the step, from
:func:`~mtraining_kernels.indexing.step_tile_lists`) in both methods and then compute exactly the pairs the lists
name (intersected with ``k_pos <= q_pos``), the same pairs as the Triton kernels.

Attention variants are keywords of both methods, declared by ``supports_window`` / ``supports_softcap`` /
``supports_documents``: ``window=`` (a sliding-window layer: pair allowed iff ``q_pos - window < k_pos <= q_pos``,
token-exact), ``softcap=`` (scores ``softcap * tanh(s / softcap)`` before masking) and ``doc_start=`` (packed
documents: ``[B or 1, Sq]`` integers, query i of batch row b sees only keys ``k_pos >= doc_start[b, i]``, its
document's first position). :class:`TorchBlockOp` and :class:`FlexBlockOp` take all three (the torch op's
soft-capped chunks take its plain path: ATen's CPU flash kernels have no cap); the Triton kernels' op
(``mtraining_kernels.vertical_slash.TritonBlockOp``) takes ``softcap=`` only (a window layer runs dense; packed
documents run the torch op, see :func:`~lightning_mtraining.ring.setup.documents_op`).

Ops:

- :class:`TorchBlockOp`: torch, chunked over queries so memory stays bounded; CPU and GPU. Plain matmul/softmax
  (the float64 reference) or, on CPU for float32/bf16/fp16, ATen's fused CPU flash-attention kernels.
- :class:`FlexBlockOp`: FlexAttention (CUDA) with a BlockMask built from the positions at tile level (no
  token-level ``create_block_mask``, which runs out of memory at 128K). FlexAttention has no public backward
  that takes an external log-sum-exp, so :meth:`FlexBlockOp.backward` recomputes the block's forward and
  back-propagates ``(w * dout, w * rowsum(dout * (out_blk - out)))`` with ``w = exp(lse_blk - lse)`` through
  ``(out_blk, lse_blk)``; this is exactly the flash backward with the global lse (derivation in the method).
- The Triton vertical-slash kernels (``mtraining_kernels``) provide the same protocol for sparse and dense work.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_mtraining.core.checks import check_softcap, check_window
from lightning_mtraining.core.numerics import acc_dtype

__all__ = ["BlockAttentionOp", "FlexBlockOp", "TorchBlockOp", "default_block_op", "merge_attention", "tile_classes"]


class BlockAttentionOp(Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's ``(block_out, block_lse)`` into the running ``(out, lse)`` by log-sum-exp, in place.

    ``out`` [B,H,S,D] and ``lse`` [B,H,S] are the float32 (or float64) accumulators; rows where both lse are -inf
    stay (0, -inf) instead of turning into NaN.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new_lse))
    w_blk = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(new_lse))
    out.mul_(w_old.unsqueeze(-1)).add_(block_out.to(out.dtype) * w_blk.unsqueeze(-1))
    lse.copy_(new_lse)
    return out, lse


def _check_block_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % Hkv:
        raise ValueError(f"bad block shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_pos.shape != (Sq,) or k_pos.shape != (Sk,):
        raise ValueError(f"positions {tuple(q_pos.shape)}/{tuple(k_pos.shape)} do not match lengths {Sq}/{Sk}")
    return B, H, Hkv, Sq, Sk, D


_FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _capped(s: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softcap * tanh(s / softcap), 1 - tanh^2)``, or ``(s, None)`` without a cap."""
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, 1 - t * t


def _check_variant(tiles, window: int | None, softcap: float | None) -> None:
    check_window(window)
    if window is not None and tiles is not None:
        raise ValueError("a sliding window and sparse tile lists do not combine: a window layer runs its band "
                         "densely (ring_attention does this)")
    check_softcap(softcap)


class TorchBlockOp:
    """Torch block op, chunked over queries so that at most ``max_scores`` score elements live at once.

    For each chunk of queries only the keys visible to the chunk's last query are computed (a prefix, since
    positions increase), and the token-level mask is applied only to the keys not visible to the chunk's first
    query: fully visible keys need no mask, fully masked keys are never touched. Chunks hold at most
    ``max_rows`` queries (default 128: one striped block at the default block size, so no entirely masked
    (query block, key block) pair is computed): small chunks waste less of the causal band than large ones.

    Two inner paths compute a chunk: plain torch matmul/softmax (any device and dtype; the float64 reference),
    and, on CPU for float32/bfloat16/float16 when ``fused=True``, ATen's fused CPU flash-attention kernels
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the merged out and log-sum-exp
    like any flash backward), same pairs, several times faster than the plain path on CPU. GQA never repeats K/V
    on either path: the G query heads of a KV group are stacked along the query axis ([B, Hkv, G*C, D]) and
    share the chunk's mask.
    """

    supports_tiles = True  # forward/backward take sparse tile lists (``tiles=``), see the module docstring
    supports_window = True  # and ``window=`` (sliding-window layers)
    supports_softcap = True  # and ``softcap=`` (tanh soft-capping of the scores)
    supports_documents = True  # and ``doc_start=`` (packed documents: a per-row lower bound on key positions)

    def __init__(self, max_scores: int = 1 << 25, fused: bool = True, max_rows: int = 128) -> None:
        if max_scores < 1 or max_rows < 1:
            raise ValueError(f"max_scores and max_rows must be positive, got {max_scores} and {max_rows}")
        self.max_scores = max_scores
        self.max_rows = max_rows
        self.fused = fused
        self._tile_cache: dict[int, tuple] = {}

    def _use_fused(self, q: torch.Tensor, softcap: float | None = None) -> bool:
        # ATen's CPU flash kernels have no soft-cap; capped scores take the plain path.
        return self.fused and softcap is None and q.device.type == "cpu" and q.dtype in _FUSED_CPU_DTYPES

    @staticmethod
    def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """0 where allowed, -inf elsewhere (what the fused CPU kernels take)."""
        return torch.where(allowed, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))

    @staticmethod
    def _additive_mask(q_pos_c, k_pos, full, visible, G, dtype):
        """[G*C, visible] additive mask (0 / -inf) for a chunk, or None when every key of the prefix is visible."""
        if full >= visible:
            return None
        allowed = k_pos[None, :visible] <= q_pos_c[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return mask.repeat(G, 1)

    def _chunks(self, B: int, H: int, Sq: int, Sk: int, q_pos: torch.Tensor, k_pos: torch.Tensor):
        size = max(1, min(Sq, self.max_rows, self.max_scores // max(1, B * H * Sk)))
        starts = list(range(0, Sq, size))
        ends = [min(s + size, Sq) for s in starts]
        idx = torch.tensor(starts, device=q_pos.device)
        last = torch.tensor(ends, device=q_pos.device) - 1
        visible = torch.searchsorted(k_pos, q_pos[last], right=True).tolist()
        full = torch.searchsorted(k_pos, q_pos[idx], right=True).tolist()
        return list(zip(starts, ends, full, visible))

    @staticmethod
    def _scores(qc, k, q_pos_c, k_pos, full, visible, scale, G, softcap=None):
        """Masked scores [B, Hkv, G*C, visible] of a query chunk qc [B, Hkv, G*C, D] in the accumulation dtype, and
        the soft-cap's derivative ``1 - tanh^2`` (None without a cap)."""
        s, dcap = _capped(torch.matmul(qc, k[:, :, :visible].transpose(-1, -2)) * scale, softcap)
        if full < visible:
            C = q_pos_c.shape[0]
            masked = k_pos[None, full:visible] > q_pos_c[:, None]  # [C, visible - full]
            s5 = s.view(s.shape[0], s.shape[1], G, C, visible)
            s5[..., full:visible].masked_fill_(masked, float("-inf"))
        return s, dcap

    def _step_masks(self, tiles, k_pos: torch.Tensor, q_pos: torch.Tensor):
        """What a step's lists allow, per query tile, kept for the step's forward and backward (the same lists
        object), a few dozen steps at a time: ``(rows [B', H', Mq, Sk] keys named, any [Mq] host bools: some row of
        the tile has a key, full [Mq]: every causal key of the tile is named (dense), first [B', H', Mq] position
        of the first named key)``."""
        from mtraining_kernels.reference import tile_rows_mask

        hit = self._tile_cache.get(id(tiles))
        if hit is not None and hit[0] is tiles:
            return hit[1]
        if len(self._tile_cache) >= 64:
            self._tile_cache.pop(next(iter(self._tile_cache)))
        rows = tile_rows_mask(tiles, k_pos.shape[0])  # [B', H', Mq, Sk]
        BM = tiles.block_m
        Mq = rows.shape[2]
        last_q = q_pos[torch.clamp(torch.arange(Mq, device=q_pos.device) * BM + BM - 1, max=q_pos.shape[0] - 1)]
        visible = k_pos[None, :] <= last_q[:, None]  # [Mq, Sk] causal keys of each tile's last query
        big = torch.iinfo(torch.int64).max
        first = torch.where(rows, k_pos.to(torch.int64), big).amin(-1)  # [B', H', Mq]
        tile_any = (first <= last_q).flatten(0, 1).any(0)
        tile_full = (rows | ~visible).flatten(0, 1).all(-1).all(0)
        masks = (rows, tile_any.tolist(), tile_full.tolist(), first)
        self._tile_cache[id(tiles)] = (tiles, masks)
        return masks

    def _tile_mask(self, tiles, q_pos, k_pos, start, end, visible, B, H, Hkv):
        """``(skip, allowed, empty_rows, keys)`` for query rows [start, end) under ``tiles``.

        ``skip``: no row has a key. ``keys``: the key indices to compute (None: the causal prefix ``:visible``);
        when the lists name at most half of the prefix, only the keys some row of the chunk needs are gathered,
        so a sparse step costs its density, not the dense prefix. ``allowed``: bool [B, Hkv, G*C, len(keys)], or
        None when the lists name every causal key (dense). ``empty_rows``: bool [B, Hkv, G*C] rows with no key.
        """
        if tiles is None:
            return False, None, None, None
        rows, tile_any, tile_full, first = self._step_masks(tiles, k_pos, q_pos)
        BM = tiles.block_m
        m0, m1 = start // BM, -(-end // BM)
        if not any(tile_any[m0:m1]):
            return True, None, None, None
        if all(tile_full[m0:m1]):
            return False, None, None, None
        keys = None
        need = rows[:, :, m0:m1, :visible].flatten(0, 2).any(0)  # [visible] keys some row of the chunk names
        if 2 * int(need.sum()) <= visible:
            keys = torch.nonzero(need).flatten()
        qt = torch.arange(start, end, device=q_pos.device) // BM
        sel = rows[:, :, qt, :visible] if keys is None else rows[:, :, qt][..., keys]
        kp = k_pos[:visible] if keys is None else k_pos[keys]
        m = sel & (kp[None, :] <= q_pos[start:end, None])
        C, G, n = end - start, H // Hkv, m.shape[-1]
        empty = first[:, :, qt] > q_pos[None, None, start:end]  # [B', H', C]
        return (False, m.expand(B, H, C, n).reshape(B, Hkv, G * C, n), empty.expand(B, H, C).reshape(B, Hkv, G * C),
                keys)

    @staticmethod
    def _window_mask(q_pos, k_pos, start, end, visible, window, B, H, Hkv):
        """``(skip, allowed, empty_rows, keys)`` for query rows [start, end) of a sliding-window layer (the same
        contract as :meth:`_tile_mask`): the keys are the range the chunk's window can reach, ``allowed`` the
        token-exact band ``q - window < k <= q``."""
        lo = int(torch.searchsorted(k_pos, q_pos[start] - window, right=True))
        if lo >= visible:
            return True, None, None, None
        keys = torch.arange(lo, visible, device=k_pos.device)
        kp, qp = k_pos[lo:visible], q_pos[start:end, None]
        m = (kp[None, :] <= qp) & (kp[None, :] > qp - window)  # [C, n]
        C, G = end - start, H // Hkv
        empty = ~m.any(-1)
        return (False, m.expand(B, H, C, m.shape[-1]).reshape(B, Hkv, G * C, m.shape[-1]),
                empty.expand(B, H, C).reshape(B, Hkv, G * C), keys)

    def _mask(self, tiles, window, q_pos, k_pos, start, end, visible, B, H, Hkv, doc_start=None):
        if window is not None:
            base = self._window_mask(q_pos, k_pos, start, end, visible, window, B, H, Hkv)
        else:
            base = self._tile_mask(tiles, q_pos, k_pos, start, end, visible, B, H, Hkv)
        if doc_start is None or base[0]:
            return base
        return self._document_mask(base, doc_start, q_pos, k_pos, start, end, visible, B, H, Hkv)

    @staticmethod
    def _document_mask(base, doc_start, q_pos, k_pos, start, end, visible, B, H, Hkv):
        """``base`` (the contract of :meth:`_tile_mask`) intersected with packed documents: row q keeps the keys
        ``k >= doc_start[b, q]``. The keys below every row's document start are not computed at all (the chunk's
        key range starts at the first key of its earliest document), and a chunk whose keys all lie in earlier
        documents is skipped."""
        _, allowed, _, keys = base
        lo = doc_start[:, start:end]  # [B', C] global position of each row's document's first token
        first = int(torch.searchsorted(k_pos[:visible].contiguous(), lo.min().reshape(1)))
        if first >= visible:
            return True, None, None, None
        C, G = end - start, H // Hkv
        if keys is None:
            kp = k_pos[first:visible]
            if allowed is not None and first:
                allowed = allowed[..., first:]
            if first:
                keys = torch.arange(first, visible, device=k_pos.device)
        else:
            kp = k_pos[keys]
        n = kp.shape[0]
        doc = (kp[None, None, :] >= lo[:, :, None]).unsqueeze(1)  # [B', 1, C, n]
        if allowed is None:  # causal only
            doc = doc & (kp[None, :] <= q_pos[start:end, None])
        m = doc.expand(B, H, C, n).reshape(B, Hkv, G * C, n)
        if allowed is not None:
            m = m & allowed
        return False, m, ~m.any(-1), keys

    @staticmethod
    def _keys(t: torch.Tensor, keys: torch.Tensor | None, visible: int) -> torch.Tensor:
        return t[:, :, :visible] if keys is None else t.index_select(2, keys)

    @staticmethod
    def _add_keys(acc: torch.Tensor, part: torch.Tensor, keys: torch.Tensor | None, visible: int) -> None:
        if keys is None:
            acc[:, :, :visible] += part
        else:
            acc.index_add_(2, keys, part.to(acc.dtype))

    def forward(self, q, k, v, q_pos, k_pos, scale, tiles=None, window=None, softcap=None, doc_start=None):
        """See the module docstring; ``window``: keys with ``q - k >= window`` are masked (a sliding-window
        layer, Hugging Face's ``sliding_window``); ``softcap``: scores become ``softcap * tanh(s / softcap)``
        before masking (Gemma 2's ``attn_logit_softcapping``); ``doc_start``: ``[B or 1, Sq]`` packed documents,
        row q of batch row b sees only keys ``k >= doc_start[b, q]`` (its document's first position)."""
        B, H, Hkv, Sq, Sk, D = _check_block_inputs(q, k, v, q_pos, k_pos)
        _check_variant(tiles, window, softcap)
        G = H // Hkv
        adt = acc_dtype(q.dtype)
        out = torch.zeros(B, H, Sq, D, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, Sq), float("-inf"), dtype=adt, device=q.device)
        q5 = q.contiguous().view(B, Hkv, G, Sq, D)
        fused = self._use_fused(q, softcap)
        kf, vf = (k, v) if fused else (k.to(adt), v.to(adt))
        for start, end, full, visible in self._chunks(B, H, Sq, Sk, q_pos, k_pos):
            if visible == 0:
                continue
            C = end - start
            skip, allowed, empty, keys = self._mask(tiles, window, q_pos, k_pos, start, end, visible, B, H, Hkv,
                                                    doc_start)
            if skip:
                continue  # nothing of this chunk is in the pattern (or the window, or its documents)
            if fused:
                qc = q5[:, :, :, start:end].reshape(B, Hkv, G * C, D)
                if allowed is None:
                    mask = self._additive_mask(q_pos[start:end], k_pos, full, visible, G, q.dtype)
                else:
                    mask = self._additive(allowed, q.dtype)
                o, lse_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qc, self._keys(k, keys, visible), self._keys(v, keys, visible), attn_mask=mask, scale=scale
                )
                if empty is not None:  # the fused kernel reports lse 0 (and out 0) for rows that see no key
                    lse_c = lse_c.masked_fill(empty, float("-inf"))
            else:
                qc = q5[:, :, :, start:end].reshape(B, Hkv, G * C, D).to(adt)
                if keys is None:
                    s, _ = self._scores(qc, kf, q_pos[start:end], k_pos, full, visible, scale, G, softcap)
                else:
                    s, _ = _capped(torch.matmul(qc, kf.index_select(2, keys).transpose(-1, -2)) * scale, softcap)
                if allowed is not None:
                    s = s.masked_fill(~allowed, float("-inf"))
                lse_c = torch.logsumexp(s, dim=-1)  # [B, Hkv, G*C]
                safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
                o = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), self._keys(vf, keys, visible))
            out.view(B, Hkv, G, Sq, D)[:, :, :, start:end] = o.reshape(B, Hkv, G, C, D).to(q.dtype)
            lse.view(B, Hkv, G, Sq)[:, :, :, start:end] = lse_c.reshape(B, Hkv, G, C).to(adt)
        if fused:
            # the fused kernel reports lse 0 (and out 0) for rows that see no key; the protocol says -inf
            lse[..., q_pos < k_pos[0]] = float("-inf")
        return out, lse

    def backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale, tiles=None, window=None, softcap=None,
                 doc_start=None):
        B, H, Hkv, Sq, Sk, D = _check_block_inputs(q, k, v, q_pos, k_pos)
        _check_variant(tiles, window, softcap)
        G = H // Hkv
        adt = acc_dtype(q.dtype)
        dq = torch.zeros(B, H, Sq, D, dtype=adt, device=q.device)
        dk = torch.zeros(B, Hkv, Sk, D, dtype=adt, device=q.device)
        dv = torch.zeros(B, Hkv, Sk, D, dtype=adt, device=q.device)
        if self._use_fused(q, softcap):
            return self._fused_backward(q, k, v, out, lse, dout, q_pos, k_pos, scale, dq, dk, dv, tiles, window,
                                        doc_start)
        kf, vf = k.to(adt), v.to(adt)
        delta = (dout.to(adt) * out.to(adt)).sum(-1)  # [B, H, Sq]
        q5, do5 = q.view(B, Hkv, G, Sq, D), dout.view(B, Hkv, G, Sq, D)
        lse4, delta4 = lse.view(B, Hkv, G, Sq), delta.view(B, Hkv, G, Sq)
        for start, end, full, visible in self._chunks(B, H, Sq, Sk, q_pos, k_pos):
            if visible == 0:
                continue
            skip, allowed, _, keys = self._mask(tiles, window, q_pos, k_pos, start, end, visible, B, H, Hkv,
                                                doc_start)
            if skip:
                continue
            C = end - start
            qc = q5[:, :, :, start:end].reshape(B, Hkv, G * C, D).to(adt)
            doc = do5[:, :, :, start:end].reshape(B, Hkv, G * C, D).to(adt)
            lc = lse4[:, :, :, start:end].reshape(B, Hkv, G * C, 1).to(adt)
            dc = delta4[:, :, :, start:end].reshape(B, Hkv, G * C, 1)
            kc, vc = self._keys(kf, keys, visible), self._keys(vf, keys, visible)
            if keys is None:
                s, dcap = self._scores(qc, kf, q_pos[start:end], k_pos, full, visible, scale, G, softcap)
            else:
                s, dcap = _capped(torch.matmul(qc, kc.transpose(-1, -2)) * scale, softcap)
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            p = torch.exp(s - torch.where(torch.isfinite(lc), lc, torch.zeros_like(lc)))
            self._add_keys(dv, torch.matmul(p.transpose(-1, -2), doc), keys, visible)
            dp = torch.matmul(doc, vc.transpose(-1, -2))
            ds = p * (dp - dc) * scale
            if dcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh^2
                ds = ds * dcap
            dq.view(B, Hkv, G, Sq, D)[:, :, :, start:end] = torch.matmul(ds, kc).view(B, Hkv, G, C, D)
            self._add_keys(dk, torch.matmul(ds.transpose(-1, -2), qc), keys, visible)
        return dq, dk, dv

    def _fused_backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale, dq, dk, dv, tiles=None, window=None,
                        doc_start=None):
        B, H, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        G = H // Hkv
        q5, do5 = q.contiguous().view(B, Hkv, G, Sq, D), dout.contiguous().view(B, Hkv, G, Sq, D)
        o5 = out.to(q.dtype).contiguous().view(B, Hkv, G, Sq, D)
        # A row with lse -inf saw no key anywhere; +inf makes its probabilities exp(s - inf) = 0 (no gradient).
        lse5 = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))).float().view(B, Hkv, G, Sq)
        for start, end, full, visible in self._chunks(B, H, Sq, Sk, q_pos, k_pos):
            if visible == 0:
                continue
            skip, allowed, _, keys = self._mask(tiles, window, q_pos, k_pos, start, end, visible, B, H, Hkv,
                                                doc_start)
            if skip:
                continue
            C = end - start
            rows = lambda t: t[:, :, :, start:end].reshape(B, Hkv, G * C, *t.shape[4:])  # noqa: E731
            if allowed is None:
                mask = self._additive_mask(q_pos[start:end], k_pos, full, visible, G, q.dtype)
            else:
                mask = self._additive(allowed, q.dtype)
            dq_c, dk_c, dv_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                rows(do5), rows(q5), self._keys(k, keys, visible), self._keys(v, keys, visible), rows(o5),
                rows(lse5), 0.0, False, attn_mask=mask, scale=scale,
            )
            dq.view(B, Hkv, G, Sq, D)[:, :, :, start:end] = dq_c.reshape(B, Hkv, G, C, D)
            self._add_keys(dk, dk_c, keys, visible)
            self._add_keys(dv, dv_c, keys, visible)
        return dq, dk, dv

    def __repr__(self) -> str:
        return f"TorchBlockOp(max_scores={self.max_scores}, max_rows={self.max_rows}, fused={self.fused})"


def tile_classes(q_pos: torch.Tensor, k_pos: torch.Tensor, tile_q: int, tile_k: int, window: int | None = None):
    """Classify (query tile, key tile) pairs by global positions: ``(full, partial, q_pos_padded, k_pos_padded)``.

    ``full[i, j]``: every query of tile i sees every key of tile j (no mask needed); ``partial[i, j]``: some but
    not all pairs are visible (token-level mask needed). Tiles that are neither are entirely masked and never
    computed. Ragged last tiles are padded with positions that see nothing (queries: -1) and are never seen
    (keys: int64 max), which makes them partial, so the token mask handles the ragged edge exactly. With a
    sliding ``window`` a key is visible to a query iff ``q - window < k <= q``.
    """
    Sq, Sk = q_pos.shape[0], k_pos.shape[0]
    nq, nk = -(-Sq // tile_q), -(-Sk // tile_k)
    qp = torch.full((nq * tile_q,), -1, dtype=torch.int64, device=q_pos.device)
    kp = torch.full((nk * tile_k,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=k_pos.device)
    qp[:Sq], kp[:Sk] = q_pos, k_pos
    qmin, qmax = qp.view(nq, tile_q).min(-1).values, qp.view(nq, tile_q).max(-1).values
    kmin, kmax = kp.view(nk, tile_k).min(-1).values, kp.view(nk, tile_k).max(-1).values
    full = (kmax[None, :] <= qmin[:, None]) & (qmin[:, None] >= 0)
    partial = kmin[None, :] <= qmax[:, None]
    if window is not None:
        # ragged-edge padding keys (int64 max) never enter ``full``, so kmin/kmax of real tiles decide here
        full &= kmin[None, :] > qmax[:, None] - window
        partial &= kmax[None, :] > qmin[:, None] - window
    return full, partial & ~full, qp, kp


try:  # torch >= 2.9 (2.11 and 2.13 have it); return_lse=True is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # pragma: no cover - older torch
    _AuxRequest = None  # type: ignore[assignment,misc]


class FlexBlockOp:
    """FlexAttention block op (CUDA). The BlockMask comes from tile-level position bounds, O((S/tile)^2) work.

    FlexAttention is compiled with ``dynamic=False``: every distinct block shape compiles once, and torch's
    recompile limit (``torch._dynamo.config.cache_size_limit``, 8 by default) then falls back to an unfused path
    that materialises the scores and runs out of memory at long context. Train on fixed-length (packed)
    sequences, as :mod:`lightning_mtraining.data.corpus` produces, or raise that limit in your script; this op does not
    change global torch settings.
    """

    supports_window = True  # forward/backward/differentiable take ``window=``, ``softcap=`` and ``doc_start=``
    supports_softcap = True
    supports_documents = True

    def __init__(self, tile: int = 128, compile: bool = True, cache_size: int = 256) -> None:
        self.tile = tile
        self.compile = compile
        self.cache_size = cache_size
        self._flex = None
        # BlockMasks by the identity of the position tensors: the ring reuses the same position tensors for
        # every layer and step (see :func:`~lightning_mtraining.ring.setup.rank_positions`), so each mask is built
        # once. Entries keep the tensors alive, so an id cannot be recycled while its entry exists.
        self._masks: dict[tuple[int, int, int | None, int | None], tuple] = {}
        self._score_mods: dict[float, object] = {}  # one function per cap, so compiled graphs are reused

    def _fn(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False) if self.compile else flex_attention
        return self._flex

    def block_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                   doc_start: torch.Tensor | None = None):
        """The BlockMask of a block: tile classes from the positions (per batch row with ``doc_start``: a key tile
        is fully visible to a query tile only if it starts at or after every query's document start, partially
        if it ends at or after some query's), the token rule in ``mask_mod``."""
        from torch.nn.attention.flex_attention import BlockMask

        T = self.tile
        Sq, Sk = q_pos.shape[0], k_pos.shape[0]
        full, partial, qp, kp = tile_classes(q_pos, k_pos, T, T, window)
        lo = None
        if doc_start is not None:
            nq = qp.shape[0] // T
            lo = torch.zeros(doc_start.shape[0], nq * T, dtype=torch.int64, device=doc_start.device)
            lo[:, :Sq] = doc_start
            kp_real = torch.where(kp == torch.iinfo(torch.int64).max, -1, kp)  # the ragged edge's padding keys
            lo_t = lo.view(-1, nq, T)
            kmin = kp.view(-1, T).min(-1).values
            kmax = kp_real.view(-1, T).max(-1).values
            seen = (full | partial)[None] & (kmax[None, None, :] >= lo_t.min(-1).values[:, :, None])  # [B', nq, nk]
            full = full[None] & (kmin[None, None, :] >= lo_t.max(-1).values[:, :, None])
            partial = seen & ~full
        else:
            full, partial = full[None], partial[None]

        def lists(m: torch.Tensor):
            counts = m.sum(-1, dtype=torch.int32)
            order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            return counts[:, None].contiguous(), order[:, None].contiguous()

        kv_num, kv_idx = lists(partial)
        full_num, full_idx = lists(full)

        if lo is not None and lo.shape[0] == 1:  # one set of documents for every batch row
            lo1 = lo[0]

            def doc_mod(b, qi, ki):
                return kp[ki] >= lo1[qi]
        elif lo is not None:
            def doc_mod(b, qi, ki):
                return kp[ki] >= lo[b, qi]

        if window is None and lo is None:
            def mask_mod(b, h, qi, ki):
                return kp[ki] <= qp[qi]
        elif lo is None:
            def mask_mod(b, h, qi, ki):
                return (kp[ki] <= qp[qi]) & (kp[ki] > qp[qi] - window)
        elif window is None:
            def mask_mod(b, h, qi, ki):
                return (kp[ki] <= qp[qi]) & doc_mod(b, qi, ki)
        else:
            def mask_mod(b, h, qi, ki):
                return (kp[ki] <= qp[qi]) & (kp[ki] > qp[qi] - window) & doc_mod(b, qi, ki)

        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=T, mask_mod=mask_mod,
                                        seq_lengths=(Sq, Sk))

    def _cached_block_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                           doc_start: torch.Tensor | None = None):
        # doc_start by identity too: the ring passes one tensor per batch to every layer and step
        key = (id(q_pos), id(k_pos), window, None if doc_start is None else id(doc_start))
        hit = self._masks.get(key)
        if hit is None:
            if doc_start is not None:  # a new batch's documents: the masks of earlier batches' are not needed again
                stale = [k for k, entry in self._masks.items() if entry[2] is not None and entry[2] is not doc_start]
                for old in stale:
                    del self._masks[old]
            if len(self._masks) >= self.cache_size:
                self._masks.pop(next(iter(self._masks)))
            hit = self._masks[key] = (q_pos, k_pos, doc_start, self.block_mask(q_pos, k_pos, window, doc_start))
        return hit[3]

    def _score_mod(self, softcap: float | None):
        if softcap is None:
            return None
        fn = self._score_mods.get(softcap)
        if fn is None:
            def fn(score, b, h, qi, ki):
                return torch.tanh(score / softcap) * softcap

            self._score_mods[softcap] = fn
        return fn

    def _call(self, q, k, v, q_pos, k_pos, scale, window=None, softcap=None, doc_start=None):
        _check_variant(None, window, softcap)
        kw = dict(score_mod=self._score_mod(softcap), block_mask=self._cached_block_mask(q_pos, k_pos, window,
                                                                                          doc_start),
                  scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if _AuxRequest is None:  # a torch without return_aux
            return self._fn()(q, k, v, return_lse=True, **kw)
        out, aux = self._fn()(q, k, v, return_aux=_AuxRequest(lse=True), **kw)  # return_lse is deprecated
        return out, aux.lse

    def forward(self, q, k, v, q_pos, k_pos, scale, window=None, softcap=None, doc_start=None):
        _check_block_inputs(q, k, v, q_pos, k_pos)
        out, lse = self._call(q, k, v, q_pos, k_pos, scale, window, softcap, doc_start)
        return out, lse.float()

    def differentiable(self, q, k, v, q_pos, k_pos, scale, window=None, softcap=None,
                       doc_start=None) -> torch.Tensor:
        """The block's output with FlexAttention's own autograd (used when a ring has a single step)."""
        return self._call(q, k, v, q_pos, k_pos, scale, window, softcap, doc_start)[0]

    def backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale, window=None, softcap=None, doc_start=None):
        # With w = exp(lse_blk - lse): out = sum_blk w * out_blk, so dL/dout_blk = w * dout and
        # dL/dlse_blk = w * rowsum(dout * (out_blk - out)). Pushing these through FlexAttention's own backward
        # gives dS = P_blk * w * (dP - rowsum(dout*out)) = P * (dP - D): the flash backward with the global lse.
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out_blk, lse_blk = self._call(qd, kd, vd, q_pos, k_pos, scale, window, softcap, doc_start)
            lse_blk32 = lse_blk.float()
            w = torch.where(torch.isfinite(lse_blk32), torch.exp(lse_blk32 - lse.float()), torch.zeros_like(lse_blk32))
            d_out = (dout.float() * w.unsqueeze(-1)).to(out_blk.dtype)
            d_lse = w * (dout.float() * (out_blk.detach().float() - out.float())).sum(-1)
            dq, dk, dv = torch.autograd.grad((out_blk, lse_blk), (qd, kd, vd), (d_out, d_lse.to(lse_blk.dtype)))
        return dq.float(), dk.float(), dv.float()

    def __repr__(self) -> str:
        return f"FlexBlockOp(tile={self.tile}, compile={self.compile})"


def default_block_op(device: torch.device) -> BlockAttentionOp:
    """The dense ring's op: the machine's fused causal kernel on each rank's own chunk (cuDNN on CUDA, ATen's flash
    kernel on CPU; a ring of one rank runs ``scaled_dot_product_attention``), and on the other blocks FlexAttention
    on CUDA, the chunked torch op elsewhere (:class:`~lightning_mtraining.ring.fused_dense.FusedDenseOp`)."""
    from lightning_mtraining.ring.fused_dense import FusedDenseOp

    return FusedDenseOp(FlexBlockOp() if device.type == "cuda" else TorchBlockOp())
