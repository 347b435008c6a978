"""The fused loss hook: a Hugging Face causal LM's loss computed from its hidden states, without its full logits.

:class:`FusedLoss` (installed by :func:`prepare_fused_loss`, by the strategies and
:func:`~lightning_mtraining.hf.parallel.apply_context_parallel` when ``fused_loss`` is on) and the model types it knows
(:data:`FUSED_LOSS_MODEL_TYPES`); the loss itself is :func:`~lightning_mtraining.hf.losses.fused_linear_cross_entropy`.
Re-exported by :mod:`lightning_mtraining.hf`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mtraining.distributed.sharding import IGNORE_INDEX

__all__ = ["FUSED_LOSS_MODEL_TYPES", "FusedLoss", "prepare_fused_loss"]


# Note [Fused loss]
# ----------------
# A causal LM called with labels computes ``logits = lm_head(h)`` for every position, [B, L, V], then upcasts them
# to float32 for the loss: at 64K tokens and Qwen2's 151,936-token vocabulary that is 18.6 GiB of bf16 logits plus
# 37 GiB in float32, more than the rest of a 3B model's step. :class:`FusedLoss` computes the same loss from the
# hidden states instead (:func:`~lightning_mtraining.hf.losses.fused_linear_cross_entropy`, logits a chunk of rows at
# a time): while a call with labels is under way, the output embedding's forward returns an empty ``[B, L, 0]``
# placeholder and keeps ``h``; the labels are taken out of the call (so the model computes no loss) and the hook
# puts back ``loss`` = sum of token losses / ``num_items_in_batch`` (or the mean when it is not given), exactly
# Hugging Face's ``ForCausalLMLoss``; ``logits`` are computed from the kept ``h`` only if the step reads them
# (``out.logits``: then they cost what they always did, plus one matmul). Only model types whose forward is known
# to be ``lm_head`` (then optionally a final soft-cap or a constant scale, taken from the config) then ``loss_function``
# are fused (FUSED_LOSS_MODEL_TYPES, each checked against the plain loss in tests/unit/test_fused_loss_models.py);
# others keep the plain loss. Mixture-of-experts models add a router loss only when labels are passed, so they are
# not in the list.
FUSED_LOSS_MODEL_TYPES = {
    # model_type: (config field of a final soft-cap, config field of a logit multiplier, of a logit divisor)
    "llama": (None, None, None),
    "mistral": (None, None, None),
    "qwen2": (None, None, None),
    "qwen3": (None, None, None),
    "phi3": (None, None, None),
    "gemma": (None, None, None),
    "gemma2": ("final_logit_softcapping", None, None),
    "granite": (None, None, "logits_scaling"),
    "cohere": (None, "logit_scale", None),
}


class FusedLoss:
    """Compute a Hugging Face causal LM's loss without materialising its logits (Note [Fused loss]).

    Installed by :func:`prepare_fused_loss`; :meth:`restore` removes it. Calls without labels (generation,
    ``predict``) are untouched and return logits as usual.
    """

    def __init__(self, model: Any, backend: str = "auto") -> None:  # a transformers PreTrainedModel
        from lightning_mtraining.hf.losses import FUSED_LOSS_BACKENDS

        if backend not in FUSED_LOSS_BACKENDS:
            raise ValueError(f"FusedLoss: backend must be one of {FUSED_LOSS_BACKENDS}, got {backend!r}")
        self.backend = backend
        model_type = getattr(model.config, "model_type", None)
        if model_type not in FUSED_LOSS_MODEL_TYPES:
            raise ValueError(f"no fused loss for model_type {model_type!r} (fused: {sorted(FUSED_LOSS_MODEL_TYPES)})")
        cap_field, mul_field, div_field = FUSED_LOSS_MODEL_TYPES[model_type]
        self.model = model
        self.head = model.get_output_embeddings()
        if not isinstance(self.head, nn.Linear):
            raise ValueError(
                f"{type(model).__name__}'s output embeddings are a {type(self.head).__name__}, not a Linear"
            )
        self.softcap = getattr(model.config, cap_field, None) if cap_field else None
        self._mul = float(getattr(model.config, mul_field, None) or 1.0) if mul_field else 1.0
        self._div = float(getattr(model.config, div_field, None) or 1.0) if div_field else 1.0
        self.logit_scale = self._mul / self._div
        self._hidden: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None
        # an instance attribute: no module or state_dict change
        self.head.forward = self._head_forward  # type: ignore[method-assign, assignment]
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            # before any other forward hook (the context-parallel hook scales the loss this one puts back)
            model.register_forward_hook(self._post_forward, with_kwargs=True, prepend=True),
        ]

    def restore(self) -> None:
        """Remove the hooks and the output embedding's forward override."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.head.__dict__.get("forward") is not None:
            del self.head.forward
        self._pending = self._hidden = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from the output embedding's input, with the model's own final operations."""
        z = type(self.head).forward(self.head, hidden)
        if self._mul != 1.0:
            z = z * self._mul
        if self._div != 1.0:
            z = z / self._div
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def _head_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pending is None:  # a call without labels (or after a failed one): the plain head
            return type(self.head).forward(self.head, x)
        self._hidden = x
        return x.new_empty(*x.shape[:-1], 0)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._pending = self._hidden = None
        if args:  # positional call: leave it to the plain path (the labels' position is model-specific)
            return None
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is None and shift is None:
            return None
        keep = kwargs.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):  # asked for some logits only: the plain path
            return None
        if kwargs.get("return_dict") is False:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("labels", None)
        kwargs.pop("shift_labels", None)
        if shift is None:  # Hugging Face's shift: position t predicts token t + 1, the last position nothing
            assert labels is not None
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        self._pending = {"targets": shift, "num_items": kwargs.pop("num_items_in_batch", None)}
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        pending, hidden = self._pending, self._hidden
        self._pending = self._hidden = None
        if pending is None:
            return output
        if hidden is None:
            raise RuntimeError(
                f"{type(module).__name__} was called with labels but never called its output embeddings: the fused "
                "loss cannot be computed (pass fused_loss=False to the strategy)"
            )
        from lightning_mtraining.hf.losses import fused_linear_cross_entropy

        targets = pending["targets"].to(hidden.device)
        total = fused_linear_cross_entropy(
            hidden, self.head.weight, targets, self.head.bias, logit_scale=self.logit_scale, softcap=self.softcap,
            backend=self.backend,
        )
        num_items = pending["num_items"]
        if num_items is None:  # Hugging Face's mean over the targets
            num_items = (targets != IGNORE_INDEX).sum()
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(total.device)
        output["loss"] = total / num_items
        output["logits"] = None
        return _lazy_logits(output, lambda: self.logits(hidden))


_LAZY_CLASSES: dict[type, type] = {}


def _lazy_logits(output: Any, make: Callable[[], torch.Tensor]) -> Any:
    """Make ``output.logits`` (and ``output["logits"]``) compute the logits on first use (``make()``, in the
    autograd graph), then call the callbacks in ``output.__dict__["_mt_on_logits"]`` on them (the context-parallel
    hook's shard tag). A step that never reads them never materialises them."""
    cls = type(output)
    lazy = _LAZY_CLASSES.get(cls)
    if lazy is None:

        def get(self):
            if self.__dict__.get("_mt_logits") is None and self.__dict__.get("_mt_make") is not None:
                value = self.__dict__.pop("_mt_make")()
                for callback in self.__dict__.get("_mt_on_logits", []):
                    callback(value)
                self.__dict__["_mt_logits"] = value
            return self.__dict__.get("_mt_logits")

        def put(self, value):
            self.__dict__.pop("_mt_make", None)
            self.__dict__["_mt_logits"] = value

        def getitem(self, key):
            if key == "logits":
                return self.logits
            return cls.__getitem__(self, key)

        lazy = type(cls.__name__, (cls,), {"logits": property(get, put), "__getitem__": getitem,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _LAZY_CLASSES[cls] = lazy
    output.__class__ = lazy
    output.__dict__["_mt_make"] = make
    output.__dict__["_mt_on_logits"] = []
    return output


def prepare_fused_loss(model: Any, backend: str = "auto") -> FusedLoss | None:
    """Install :class:`FusedLoss` on ``model`` if its type is in ``FUSED_LOSS_MODEL_TYPES`` (else None: the model
    keeps its plain loss); ``backend`` as :func:`~lightning_mtraining.hf.losses.fused_linear_cross_entropy`'s."""
    if getattr(model.config, "model_type", None) not in FUSED_LOSS_MODEL_TYPES:
        return None
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return None
    return FusedLoss(model, backend)
