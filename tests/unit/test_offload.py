"""``offload_activations`` (Note [Offloading some layers]): which saved tensors go to host memory, all or those of
the first N decoder layers, and that the losses and gradients stay the same.

One process, a tiny float32 Llama of 3 layers (``helpers.models``). On the CPU nothing moves, but the hooks decide
and count as on a GPU, and the count is what these tests read.
"""

from __future__ import annotations

import pytest
import torch

from helpers.models import VOCAB, make_model

SEQ = 24


def _step(offload, checkpointing=True):
    from lightning_mtraining.hf.offload import ActivationOffload

    model = make_model("llama", seed=0, num_hidden_layers=3)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    x = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    hooks = ActivationOffload(model, None if offload is True else offload, pin_memory=False) if offload else None
    context = hooks() if hooks is not None else torch.enable_grad()
    with context:
        loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, hooks


def test_offloading_some_layers_counts_their_inputs():
    """With checkpointing each layer saves its input ``[2, 24, 32]`` (float32: 6144 bytes) at the checkpoint's entry:
    offloading N layers takes exactly N of those (the embeddings save only their int64 indices before)."""
    hidden = 2 * SEQ * 32 * 4
    counts = {}
    for n in (1, 2, 3, True):
        _, _, hooks = _step(n)
        counts[str(n)] = (hooks.offloaded, hooks.offloaded_bytes)  # str: True == 1 as a dict key
    assert counts["1"][0] < counts["2"][0] < counts["3"][0] < counts["True"][0], counts
    assert counts["2"][1] - counts["1"][1] == hidden  # the second layer's input, nothing else
    assert counts["3"][1] - counts["2"][1] == hidden
    assert counts["True"][1] > counts["3"][1]  # all: the final norm and the loss's tensors too


def test_offloading_changes_no_loss_or_gradient():
    want_loss, want_grads, _ = _step(False)
    for n in (2, True):
        loss, grads, _ = _step(n)
        assert loss == want_loss  # the same arithmetic: the hooks only hold the saved tensors elsewhere
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=0, atol=0, msg=lambda s: f"{name}: {s}")


def test_offload_without_checkpointing_and_errors():
    from lightning_mtraining.hf.offload import ActivationOffload

    _, _, one = _step(1, checkpointing=False)
    _, _, every = _step(True, checkpointing=False)
    assert 0 < one.offloaded < every.offloaded  # the first layer's saved tensors, not the others'
    with pytest.raises(ValueError, match=r"offload_activations=4 decoder layers, but the model has 3; use 1 to 3"):
        ActivationOffload(make_model("llama", num_hidden_layers=3), 4)
    hooks = ActivationOffload(make_model("llama"), 1)
    hooks.remove()
    assert hooks._handles == []
