"""Labels at padded positions: one device's loss, or a clear error; never a silent difference.

With right padding and ``labels = input_ids`` (labels not -100 where ``attention_mask`` is 0), Hugging Face counts
the padded positions' targets, which ring attention cannot reproduce (Note [Labels at padding] in
``lightning_mtraining.distributed.sharding``). On 2 gloo ranks (dense ring, striped, 37 tokens padded to 64, one
row right-padded by 6) every way such labels reach a loss is refused on both ranks alike: in the batch, built in
the step and passed as ``labels=``, and through ``causal_lm_loss`` (labels, and next-token targets with
``shifted=True``). With the fix the error names (-100 at padding) the loss is one device's: a Hugging Face Llama
(eager attention) on the whole batch, to 2e-5 (float32, blockwise against one softmax: ~1e-6, see
``test_strategy.py``). One device with the unmasked labels gives another loss (by more than 1e-5 here), which is why
those labels cannot be accepted silently. ``causal_lm_loss(logits, batch)`` on a batch without labels (targets from
``input_ids``) gives padding no target, on one device and on the ranks alike.
"""

from __future__ import annotations

import torch

from helpers.dist import run_distributed
from helpers.models import VOCAB, make_model

SEQ, PAD = 37, 6
LOSS_TOL = 2e-5  # see the module docstring


def _batch(masked: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -PAD:] = 0
    ids[1, -PAD:] = 0  # the pad token
    labels = ids.masked_fill(mask == 0, -100) if masked else ids.clone()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _worker(rank: int, world_size: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel, causal_lm_loss

    model = make_model("llama")
    cp = apply_context_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)),
                                block_size=16, fused_loss=False)
    out: dict[str, object] = {}

    def error(fn) -> str | None:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    out["in_batch"] = error(lambda: cp.shard(_batch(masked=False)))
    plain = {k: v for k, v in _batch(masked=False).items() if k != "labels"}
    sharded = cp.shard(plain)
    out["built_in_step"] = error(lambda: model(**sharded, labels=sharded["input_ids"].clone()))
    with torch.no_grad():
        logits = model(**sharded).logits
        out["helper"] = error(lambda: causal_lm_loss(logits, sharded["input_ids"].clone()))
        out["helper_shifted"] = error(lambda: causal_lm_loss(logits, sharded["input_ids"].clone(), shifted=True))
        out["input_ids_targets"] = float(causal_lm_loss(logits, sharded))  # no labels: targets from input_ids
        out["fixed"] = float(model(**cp.shard(_batch(masked=True))).loss)
    return out


def test_labels_at_padding_are_refused_or_give_one_devices_loss():
    from lightning_mtraining import causal_lm_loss

    model = make_model("llama")  # eager attention, the whole batch: plain Hugging Face on one device
    with torch.no_grad():
        want = float(model(**_batch(masked=True)).loss)
        unmasked = float(model(**_batch(masked=False)).loss)
        plain = {k: v for k, v in _batch(masked=False).items() if k != "labels"}
        want_input_ids = float(causal_lm_loss(model(**plain).logits, plain))
    assert abs(unmasked - want) > 1e-5  # the padded targets change Hugging Face's loss: dropping them is visible
    assert abs(want_input_ids - want) < 1e-6  # input_ids as targets: padding has none on one device too

    for rank, got in enumerate(run_distributed(_worker, 2)):
        for where in ("in_batch", "built_in_step", "helper", "helper_shifted"):
            message = got[where]
            assert message is not None, f"rank {rank}: labels at padding were accepted ({where})"
            assert "targets at padded positions (attention_mask 0)" in message, message
            assert "labels = input_ids.masked_fill(attention_mask == 0, -100)" in message, message
        assert "in rows [1]" in got["in_batch"]
        assert abs(got["fixed"] - want) < LOSS_TOL, (rank, got["fixed"], want)
        assert abs(got["input_ids_targets"] - want) < LOSS_TOL, (rank, got["input_ids_targets"], want)
