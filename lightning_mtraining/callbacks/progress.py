"""Lightning's default progress bar, with a training description that reads right when the run is bounded by steps.

With ``Trainer(max_steps=N)`` and no ``max_epochs`` Lightning sets ``max_epochs=-1`` (no bound), and its Rich progress
bar (the default when ``rich`` is installed) then labels the training bar ``Epoch 0/-2``. :func:`progress_bar` gives
the bar Lightning would pick, with ``Epoch 0`` in that case and Lightning's own label otherwise.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

__all__ = ["StepBoundRichProgressBar", "progress_bar"]


class StepBoundRichProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` whose training bar reads ``Epoch E`` (not ``Epoch
    E/-2``) when the number of epochs is unbounded (``max_epochs`` of -1, as ``max_steps`` alone sets it)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 1:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        # Lightning pads it to the validation label's length so that the two bars do not flicker
        return f"{description:{len(self.validation_description)}}"


def progress_bar(**kwargs: Any) -> RichProgressBar | TQDMProgressBar:
    """The progress bar Lightning picks by default (Rich when installed, else TQDM; ``kwargs`` go to it), the Rich one
    as :class:`StepBoundRichProgressBar`. For ``Trainer(callbacks=[progress_bar()])``."""
    try:
        return StepBoundRichProgressBar(**kwargs)
    except ModuleNotFoundError:  # RichProgressBar's own answer when rich is not installed
        return TQDMProgressBar(**kwargs)
