"""Activation offload to host memory, for every saved tensor or only the first N decoder layers' (the strategies'
``offload_activations``).

Note [Offloading some layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With activation checkpointing a decoder layer keeps one tensor for backward: its input hidden states (``[B, S,
hidden]``, 4 GiB per layer at 1M tokens and hidden 2048 in bf16). Offloading all of them moves the whole stack to host
memory (144 GiB for 36 layers), more than a 128 GB host holds; keeping all of them on the GPU leaves no room either.
``offload_activations=N`` puts the saved tensors of the first N decoder layers in pinned host memory and keeps the
rest on the device, so the split can follow both memories.

A tensor is saved for backward at the moment an autograd node records it, which under Hugging Face's checkpointing
is the layer's input at the checkpoint's entry, *before* the layer's own forward hooks run. So the hooks here count
the decoder layers that have finished in the current forward (a forward hook on each layer, reset by a pre-hook on
each Hugging Face model), and a tensor saved while fewer than N have finished belongs to one of the first N layers
(or to the embeddings before them): it goes to the host. Tensors saved after the N-th layer (later layers, the final
norm, the loss) stay. Backward brings each offloaded tensor back to its device when its node runs.

On the CPU there is nothing to move; the hooks still decide and count (:attr:`ActivationOffload.offloaded`), which the
tests read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_mtraining.hf.model import decoder_layers, find_hf_models

__all__ = ["ActivationOffload"]


class ActivationOffload:
    """Offload what autograd saves inside :meth:`__call__`'s context to host memory: the tensors saved before the
    first ``layers`` decoder layers of the Hugging Face models in ``module`` have finished (Note [Offloading some
    layers]); ``layers=None`` offloads everything, as ``torch.autograd.graph.save_on_cpu`` does (the strategies use
    torch's for ``offload_activations=True``; this one also counts). :meth:`remove` takes the counting hooks off.

    ``offloaded`` counts the tensors (and ``offloaded_bytes`` their bytes) the last context sent to the host, or would
    have on the CPU, where nothing moves.
    """

    def __init__(self, module: nn.Module, layers: int | None = None, pin_memory: bool = True,
                 owner: str = "ActivationOffload") -> None:
        self.layers = layers
        self.pin_memory = pin_memory
        self.finished = 0
        self.offloaded = 0
        self.offloaded_bytes = 0
        self._handles: list[Any] = []
        if layers is None:
            return
        found = decoder_layers(module)
        if not 1 <= layers <= len(found):
            raise ValueError(
                f"{owner}: offload_activations={layers} decoder layers, but the model has {len(found)}; use 1 to "
                f"{len(found)} (the first layers' saved tensors go to host memory), True for all of them, or False"
            )
        for model in find_hf_models(module):
            self._handles.append(model.register_forward_pre_hook(self._reset))
        for layer in found:
            self._handles.append(layer.register_forward_hook(self._count))

    def _reset(self, *_: Any) -> None:
        self.finished = 0

    def _count(self, *_: Any) -> None:
        self.finished += 1

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.layers is not None and self.finished >= self.layers:
            return tensor
        self.offloaded += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=self.pin_memory and not tensor.is_sparse)
        host.copy_(tensor, non_blocking=self.pin_memory)
        return tensor.device, host

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """The context in which saved tensors are offloaded (a training step's forward and loss)."""
        self.finished = self.offloaded = self.offloaded_bytes = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
