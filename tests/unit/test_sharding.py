"""Batch sharding: padding to the layout unit, global label shift, per-rank shards, global target counts.

Everything is exact integer/bool bookkeeping, so comparisons are exact (torch.equal). The reference for the
shift is Hugging Face's own ``ForCausalLMLoss`` rule applied to the full, unsharded row.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mtraining.core.layouts import LAYOUTS, layout_unit, unshard_sequence
from lightning_mtraining.distributed.sharding import (
    IGNORE_INDEX,
    check_right_padding,
    shard_batch,
    shift_labels,
    shift_labels_sharded,
)


def _batch(B: int = 2, S: int = 13) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -4:] = 0  # right padding in row 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[0, 2] = IGNORE_INDEX  # a user-ignored target
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "token_type_ids": torch.zeros(B, S, dtype=torch.long),
        "position_ids": torch.arange(S).expand(B, S),
        "idx": torch.tensor([7, 9]),  # not a sequence tensor: passes through
        "source": "unit-test",
    }


def _hf_shift(labels: torch.Tensor) -> torch.Tensor:
    # transformers.loss.loss_utils.ForCausalLMLoss: pad one ignore_index on the right, drop the first.
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_shards_reassemble_to_padded_batch(layout: str, cp_size: int):
    batch = _batch()
    S, bs = 13, 2
    unit = layout_unit(layout, cp_size, bs)
    P = -(-S // unit) * unit
    shards = [shard_batch(batch, cp_rank=r, cp_size=cp_size, layout=layout, block_size=bs) for r in range(cp_size)]
    for sb in shards:
        assert sb.seq_len == S and sb.padded_len == P and sb.local_len == P // cp_size
        assert sb.batch["source"] == "unit-test" and sb.batch["idx"] is batch["idx"]
    full = {k: unshard_sequence([sb.batch[k] for sb in shards], 1, layout, bs) for k in
            ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")}
    assert torch.equal(full["input_ids"][:, :S], batch["input_ids"])
    assert torch.equal(full["input_ids"][:, S:], torch.zeros(2, P - S, dtype=torch.long))
    assert torch.equal(full["attention_mask"][:, S:], torch.zeros(2, P - S, dtype=torch.long))
    assert torch.equal(full["labels"][:, S:], torch.full((2, P - S), IGNORE_INDEX))
    assert torch.equal(full["position_ids"], torch.arange(P).expand(2, P))  # counting continues into padding
    positions = unshard_sequence([sb.position_ids for sb in shards], 1, layout, bs)
    assert torch.equal(positions, torch.arange(P)[None])

    # Targets: the HF shift of the full row, padding (attention_mask 0 and added tokens) ignored.
    want = _hf_shift(batch["labels"])
    got = unshard_sequence([sb.targets["labels"] for sb in shards], 1, layout, bs)
    assert torch.equal(got[:, :S], want)
    assert (got[:, S:] == IGNORE_INDEX).all()
    assert all(sb.num_targets["labels"] == int((want != IGNORE_INDEX).sum()) for sb in shards)
    # input_ids used as labels: padded positions must not become targets.
    want_ids = _hf_shift(batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX))
    got_ids = unshard_sequence([sb.targets["input_ids"] for sb in shards], 1, layout, bs)
    assert torch.equal(got_ids[:, :S], want_ids)
    # Identity lookup used by the model hook.
    assert shards[0].targets_for(shards[0].batch["labels"])[0] is shards[0].targets["labels"]
    assert shards[0].targets_for(shards[0].batch["labels"].clone()) is None


def test_shift_boundary_target_is_kept():
    """The token after a shard boundary is the target of the last token before it (lost by a local shift)."""
    ids = torch.arange(1, 9)[None]  # 8 tokens, cp 2 contiguous: shard 0 = 1..4, shard 1 = 5..8
    sb0 = shard_batch({"input_ids": ids, "labels": ids}, cp_rank=0, cp_size=2, layout="contiguous")
    assert sb0.targets["labels"].tolist() == [[2, 3, 4, 5]]
    assert sb0.num_targets["labels"] == 7


def test_shift_labels_sharded_single_rank_matches_shard_batch():
    batch = _batch()
    sb = shard_batch(batch, cp_rank=0, cp_size=1, layout="striped", block_size=4)
    shifted, count = shift_labels_sharded(sb.batch["input_ids"], sb.valid, group=None, cp_rank=0, cp_size=1,
                                          layout="striped", block_size=4)
    assert torch.equal(shifted, sb.targets["input_ids"]) and count == sb.num_targets["input_ids"]


def test_shift_labels_masks_invalid_next_token():
    labels = torch.tensor([[5, 6, 7, 8]])
    valid = torch.tensor([[True, True, True, False]])
    assert shift_labels(labels, valid).tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX]]


def test_bad_batches_raise_clear_errors():
    batch = _batch()
    with pytest.raises(KeyError, match="no 'input_ids'"):
        shard_batch({"labels": batch["labels"]}, cp_rank=0, cp_size=2)
    with pytest.raises(TypeError, match="mapping with 'input_ids'"):
        shard_batch(batch["input_ids"], cp_rank=0, cp_size=2)
    left = dict(batch, attention_mask=torch.tensor([[0] * 3 + [1] * 10, [1] * 13]))
    with pytest.raises(ValueError, match=r"rows \[0\] have padding before real tokens.*right padding only"):
        shard_batch(left, cp_rank=0, cp_size=2)
    hole = torch.ones(2, 13, dtype=torch.long)
    hole[1, 5] = 0
    with pytest.raises(ValueError, match="left padding or holes"):
        check_right_padding(hole)
    with pytest.raises(ValueError, match="custom attention masks are not supported"):
        shard_batch(dict(batch, attention_mask=torch.ones(2, 1, 13, 13)), cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="unknown layout"):
        shard_batch(batch, cp_rank=0, cp_size=2, layout="diagonal")
