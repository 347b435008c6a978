"""``RingTraceCallback``: measure the ring's per-step compute, communication waits and bytes in chosen training steps
and log their means to Lightning's loggers.

Every ``log_every_n_steps``-th optimizer step it enables a :class:`~lightning_mtraining.ring.trace.RingTrace` from
``on_train_batch_start`` to ``on_train_batch_end`` (the forward, the backward and the optimizer step of that batch)
and logs :meth:`~lightning_mtraining.ring.trace.RingTrace.summary` under ``ring/``, e.g.
``ring/fwd/sparse/compute_ms``, ``ring/bwd/sparse/wait_outer_ms``, ``ring/fwd/dense/bytes_inner`` (means per ring step
of this rank; ``inner`` is the intra-node ring, ``outer`` the inter-node ring of a hierarchical ring), plus
``ring/{phase}/{ring}/hidden`` = 1 - wait / (compute + wait), the share of the step's time not spent waiting.
Other steps run with the instrumentation off (no cost). Values are this rank's (global rank 0's in the logger
unless ``sync_dist=True`` averages them over the ranks: one all-reduce per key).

On CUDA the step's CUDA events are resolved at ``on_train_batch_end`` (one ``torch.cuda.synchronize``).

Example::

    trainer = Trainer(strategy=MTrainingStrategy(...), callbacks=[RingTraceCallback(log_every_n_steps=50)])
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.ring.trace import RingTrace

__all__ = ["RingTraceCallback"]


class RingTraceCallback(Callback):
    """Log the ring instrumentation's per-step means every ``log_every_n_steps`` optimizer steps.

    Args:
        log_every_n_steps: measure every n-th optimizer step (default: the Trainer's ``log_every_n_steps``).
        prefix: the logged keys' prefix.
        sync_dist: average the values over all ranks before logging (one all-reduce per key).
    """

    def __init__(self, log_every_n_steps: int | None = None, prefix: str = "ring", sync_dist: bool = False) -> None:
        n = log_every_n_steps
        if n is not None and not is_int(n):
            raise ValueError(f"RingTraceCallback: log_every_n_steps must be a positive int or None, got "
                             f"{log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.sync_dist = sync_dist
        self.trace = RingTrace()
        self._recording = False

    def _due(self, trainer: Any) -> bool:
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        return trainer.global_step % max(1, every) == 0

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._due(trainer):
            self.trace.reset()
            self.trace.__enter__()
            self._recording = True

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._recording:
            return
        self.trace.__exit__(None, None, None)
        self._recording = False
        summary = self.trace.summary()
        self.trace.reset()
        if not summary:
            return
        logged = {f"{self.prefix}/{k}": v for k, v in summary.items()}
        for key in {k.rsplit("/", 1)[0] for k in summary}:  # "fwd/sparse", ...
            wait = sum(v for k, v in summary.items() if k.startswith(f"{key}/wait_"))
            busy = summary[f"{key}/compute_ms"] + wait
            logged[f"{self.prefix}/{key}/hidden"] = 1.0 - wait / busy if busy > 0 else 1.0
        pl_module.log_dict(logged, on_step=True, on_epoch=False, sync_dist=self.sync_dist)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._recording:
            self.trace.__exit__(None, None, None)
            self._recording = False
