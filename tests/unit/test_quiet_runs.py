"""What a run prints that a user cannot act on, silenced where it arises, and nothing else silenced.

- Lightning 2.6's data loop builds a ``LeafSpec``, which torch 2.13 deprecates: the strategy filters that one warning
  from that one Lightning module (a warning of the user's own passes);
- Lightning's Rich progress bar labels a run bounded by ``max_steps`` ``Epoch 0/-2``: ``progress_bar()`` labels it
  ``Epoch 0``, and keeps ``Epoch 0/2`` for three epochs.

A one-device ``Trainer`` fit of a tiny Llama for 2 steps, on CPU. (The wrapped dense-cost note:
``tests/distributed/test_sparse_training.py``; transformers' progress bars while loading: ``test_pretrained.py``.)
"""

from __future__ import annotations

import warnings

import torch

from helpers.models import make_model

LEAFSPEC = "is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"


def _fit(strategy, **trainer_kwargs):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model("llama")

        def training_step(self, batch, batch_idx):
            warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(1, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, **trainer_kwargs)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    return trainer


def _warnings_of(strategy_factory) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(strategy_factory(), max_steps=2, enable_progress_bar=False)
    return [str(w.message) for w in caught]


def test_the_leafspec_deprecation_is_filtered_and_nothing_else():
    from lightning_mtraining import MTrainingStrategy

    plain = _warnings_of(lambda: "auto")
    ours = _warnings_of(lambda: MTrainingStrategy(sparsity=None))
    assert not [m for m in ours if LEAFSPEC in m], ours
    assert "a warning of the user's own" in ours
    if torch.__version__.startswith("2.13"):  # the torch that deprecates LeafSpec: Lightning's loop does warn
        assert [m for m in plain if LEAFSPEC in m], plain


def test_a_step_bound_run_reads_epoch_0_not_epoch_0_of_minus_2():
    from lightning.pytorch.callbacks import RichProgressBar

    from lightning_mtraining.callbacks import progress_bar

    bar = progress_bar()
    assert isinstance(bar, RichProgressBar)  # rich is installed here: Lightning's default would be Rich too
    bounded = progress_bar()
    with warnings.catch_warnings():  # the warnings of the test above, which are not this test's subject
        warnings.simplefilter("ignore")
        _fit("auto", max_steps=2, callbacks=[bar])
        _fit("auto", max_epochs=3, limit_train_batches=1, callbacks=[bounded])
    assert bar.trainer.max_epochs == -1  # what max_steps alone sets
    assert bar._get_train_description(0).strip() == "Epoch 0"
    assert bounded._get_train_description(0).strip() == "Epoch 0/2"  # Lightning's own label where it is right
