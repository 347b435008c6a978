"""Hugging Face models under context parallelism: validation, preparation (ring attention and the model hooks) and the
non-finite watch.

A ``transformers`` causal LM trains under context parallelism with no change to the user's code:

1. :func:`prepare_model` checks the model (features ring attention cannot reproduce exactly are errors),
   switches it to the attention function registered as ``"mtraining_ring"`` (no "flash" in the name:
   transformers would try to fetch such a name as a hub kernel) and attaches a :class:`RingAttentionConfig`
   to each attention module (the CP group, layout, block size, per-layer sparsity).
2. A forward pre-hook on the outermost model gives every shard what a full sequence would have had:
   its *global* ``position_ids`` (RoPE), globally shifted labels (``shift_labels=``) and the global target
   count (``num_items_in_batch=``), even when ``training_step`` passes only ``input_ids`` and ``labels``.
3. A forward hook makes the *value* of ``outputs.loss`` the exact loss of the full sequence, marks it for the
   strategies' loss check (Note [Checking the loss] in :mod:`lightning_mtraining.hf.losses`), and tags the logits
   as this rank's shard (:func:`~lightning_mtraining.distributed.sharding.shard_of`), so that
   :func:`~lightning_mtraining.hf.losses.causal_lm_loss` and the output gathering can find the batch they belong to.

Note [Exact losses and gradients]
---------------------------------
Rank r of a CP group of size C holds a share of the sequence's N target tokens. Its loss tensor is
``L_r = C / N * sum(local token losses)`` (``num_items_in_batch = N / C``), so ``mean_r L_r`` is the exact
loss and DDP's gradient mean over all ``dp x cp`` ranks gives exactly the gradient of the mean over DP groups
of each group's exact loss (what DDP computes for plain data parallelism). ``L_r`` alone is a partial sum,
so the hook returns ``L_r + (mean_r L_r - L_r).detach()``: the value every rank sees, logs and shows in the
progress bar is the exact loss of its CP group's sample, while the gradient is that of ``L_r``. One scalar
all-reduce over the CP group per forward. ``self.log(..., sync_dist=True)`` then averages over DP groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.core.errors import same_on_ranks_of
from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.distributed.sharding import IGNORE_INDEX, shift_labels_sharded, tag_shard
from lightning_mtraining.hf.attention import (
    ATTENTION_NAME,
    CONFIG_ATTR,
    RingAttentionConfig,
    attention_dropout_fields,
    register_attention,
    track_straight_module,
)
from lightning_mtraining.hf.losses import exact_group_loss

__all__ = ["NonFiniteWatch", "PreparedModel", "SUPPORTED_LAYER_TYPES", "attention_modules", "decoder_layers",
           "find_hf_models", "packed_documents_cache_error", "prepare_model", "validate_model"]


def packed_documents_cache_error(name: str) -> ValueError:
    """The error for packed documents with ``use_cache=True``, the same on one device and under context parallelism:
    transformers' own attention ignores the document boundaries when a cache is made, and a training forward has
    no use for one."""
    return ValueError(
        f"{name} received packed documents (position_ids that restart) with use_cache=True: transformers' attention "
        "ignores the document boundaries when it makes a cache, and training needs none. Pass use_cache=False (or "
        "nothing) when training on packed sequences"
    )


class NonFiniteWatch:
    """Whether each attention layer's input hidden states and output were finite in the last forward, as device
    flags (no host sync while the model runs), to name where a non-finite loss came from.

    Forward hooks on every attention module of ``models`` (:func:`attention_modules`; with any attention
    implementation, so SDPA at one device too) record two bool tensors per layer; :meth:`report` turns them into a
    message once the loss is known to be non-finite. Cost: two ``isfinite().all()`` reductions over ``[B, L, hidden]``
    per layer and forward (not again in a checkpointed layer's recompute). :meth:`restore` removes the hooks.
    """

    def __init__(self, models: list[nn.Module]) -> None:
        self.flags: dict[int, tuple[str, torch.Tensor]] = {}
        self._handles = []
        order = 0
        for model in models:
            names = {m: n for n, m in model.named_modules()}
            for module in attention_modules(model):
                label = f"{type(model).__name__}.{names.get(module, type(module).__name__)}"
                self._handles.append(module.register_forward_hook(self._hook(order, label), with_kwargs=True))
                order += 1

    def _hook(self, order: int, label: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # an activation-checkpointing recompute inside backward (compiled code replays no hooks there)
            if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
                return
            hidden = args[0] if args else kwargs.get("hidden_states")
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(hidden, torch.Tensor) or not isinstance(out, torch.Tensor):
                return
            with torch.no_grad():
                flags = torch.stack([torch.isfinite(hidden).all(), torch.isfinite(out).all()])
            self.flags[order] = (f"{label} (layer {getattr(module, 'layer_idx', '?')})", flags)

        return hook

    def report(self) -> str:
        """Where the last forward's values first stopped being finite, in layer order (one host sync)."""
        if not self.flags:
            return "no attention layer ran in the last forward"
        keys = sorted(self.flags)
        ok = torch.stack([self.flags[k][1] for k in keys]).cpu()
        for i, k in enumerate(keys):
            label = self.flags[k][0]
            if not ok[i, 0]:
                before = "; every earlier attention layer's input was finite" if i else ""
                return (f"the input hidden states of {label} were already non-finite{before}: the value arose before "
                        "this attention (the embeddings, an earlier layer's MLP, or this layer's input norm)")
            if not ok[i, 1]:
                return (f"{label} produced non-finite output from finite input hidden states (attention or its "
                        "projections overflowed: in float16, try bf16; check the learning rate and the scale)")
        return ("every attention layer's input and output were finite: the non-finite value arose after the last "
                "attention layer (MLP, final norm, output embedding, the loss) or in the targets")

    def restore(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.flags = {}


def _is_hf_model(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def find_hf_models(root: nn.Module) -> list[Any]:
    """The outermost ``transformers.PreTrainedModel`` instances inside ``root`` (``root`` itself included)."""
    found: list[Any] = []  # transformers PreTrainedModel instances

    def visit(m: nn.Module) -> None:
        if _is_hf_model(m):
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(root)
    return found


def attention_modules(model: nn.Module) -> list[Any]:
    """The attention modules of a Hugging Face model (they hold ``layer_idx`` and ``is_causal``)."""
    # Decoder layers hold a layer index but no causality flag.
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx") and m is not model]


# Hugging Face ``config.layer_types`` entries that ring attention computes exactly: full causal attention, and
# causal attention in a sliding window (the window comes from the layer's ``sliding_window`` at call time).
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def validate_model(model: nn.Module) -> None:
    """Raise a clear error if ring attention cannot reproduce ``model``'s attention exactly."""
    name = type(model).__name__
    config = getattr(model, "config", None)

    def fail(feature: str, advice: str) -> None:
        raise ValueError(f"{name} cannot be trained with MTraining ring attention: {feature}. {advice}")

    if not getattr(model, "_supports_attention_backend", False):
        fail(
            "unknown attention (the model does not dispatch through transformers' AttentionInterface)",
            "Use a model whose attention supports `attn_implementation` (Llama, Qwen2, Mistral, ...).",
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if other:
        fail(
            f"layer types {other} are in use",
            f"Ring attention computes the layer types {sorted(SUPPORTED_LAYER_TYPES)} (causal attention, "
            "optionally in a sliding window).",
        )
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        window = config.sliding_window
        if not is_int(window):
            fail(f"config.sliding_window={window!r} is not a positive int", "Set it to the window in tokens or None.")
    dropout = attention_dropout_fields(config)
    if dropout:
        fields = ", ".join(f"config.{k}={v}" for k, v in dropout.items())
        fail(f"attention dropout ({fields})", f"Set {' and '.join(f'config.{k}' for k in dropout)} to 0.0.")
    modules = attention_modules(model)
    if not modules:
        fail("unknown attention (no attention module with `is_causal` and `layer_idx` found)",
             "Use a model whose attention supports `attn_implementation` (Llama, Qwen2, Mistral, ...).")
    sinks = [type(m).__name__ for m in modules if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    if sinks:
        fail(f"learned attention sinks ({sinks[0]}.sinks, as in gpt-oss)", "Ring attention has no sink logits.")
    non_causal = [type(m).__name__ for m in modules if m.is_causal is False]
    if non_causal or getattr(config, "is_causal", True) is False:
        where = non_causal[0] if non_causal else "config.is_causal=False"
        fail(f"non-causal attention ({where})", "Ring attention computes causal attention only.")


class PreparedModel:
    """A model switched to ring attention with its hooks installed; :meth:`restore` undoes everything."""

    def __init__(
        self,
        model: Any,  # a transformers PreTrainedModel
        plan: ContextParallelPlan,
        layer_sparsity: Callable[[int], Any] | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self._previous_attn = model.config._attn_implementation
        self._forward_params = list(inspect.signature(model.forward).parameters)
        self._scale_loss = False
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            raise ValueError(
                f"{type(model).__name__} did not accept attn_implementation={ATTENTION_NAME!r} "
                f"(it kept {model.config._attn_implementation!r}): unknown attention"
            )
        self.attention_modules = attention_modules(model)
        plan.layer_ids = tuple(sorted(set(plan.layer_ids) | {m.layer_idx for m in self.attention_modules}))
        for m in self.attention_modules:
            sparsity = layer_sparsity(m.layer_idx) if layer_sparsity is not None else None
            setattr(
                m,
                CONFIG_ATTR,
                RingAttentionConfig(
                    plan.group, plan.cp_size, plan.layout, plan.block_size, sparsity, plan.inner_group,
                    plan.outer_group, plan, torch.tensor([plan.uid, _layer_number(m)], dtype=torch.int64),
                ),
            )
            track_straight_module(m, getattr(m, CONFIG_ATTR))
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
        ]

    def restore(self) -> None:
        """Remove the hooks and per-layer configs and restore the previous attention implementation."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.attention_modules:
            if hasattr(m, CONFIG_ATTR):
                delattr(m, CONFIG_ATTR)
        self.model.set_attn_implementation(self._previous_attn)

    def _check_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> dict:
        """The forward's keyword arguments (positional ones named), checked against the current shard; starts the
        forward's pattern cache. Raises on inputs ring attention cannot take."""
        name = type(module).__name__
        if args:  # positional call, e.g. model(input_ids): name the arguments so they can be inspected
            if len(args) > len(self._forward_params):
                raise TypeError(f"{name}.forward got {len(args)} positional arguments")
            kwargs = {**dict(zip(self._forward_params, args)), **kwargs}
        plan, cur = self.plan, self.plan.current
        plan.begin_forward(training=module.training and torch.is_grad_enabled())  # Note [One pattern per forward]
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError(f"{name} was called without input_ids or inputs_embeds")
        if cur is None:
            raise RuntimeError(
                f"{name} was called under context parallelism before any batch was sharded; pass the model the "
                "batch the strategy gives training_step/validation_step (Fabric: iterate the dataloader returned by "
                "fabric.setup_dataloaders, or call strategy.shard_batch(batch))"
            )
        if x.shape[1] != cur.local_len:
            raise ValueError(
                f"{name} received a sequence of {x.shape[1]} tokens, but this rank's shard of the current batch has "
                f"{cur.local_len} (global {cur.padded_len} = {plan.cp_size} ranks x {cur.local_len}); pass the "
                "sharded batch the strategy gives you, not the full sequence"
            )
        if kwargs.get("past_key_values") is not None:
            raise ValueError(f"{name}: a KV cache (past_key_values) is not supported under context parallelism")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2:
                raise ValueError(
                    f"{name} received a {mask.dim()}D attention mask: custom attention masks are not supported by "
                    "ring attention"
                )
            # A 2D padding mask was checked (right padding only) when the batch was sharded; causality makes
            # it a no-op for every real token, and padded targets are -100.
            kwargs["attention_mask"] = None
        if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
            raise ValueError(
                f"{name} was asked for output_attentions: ring attention never materialises the attention weights "
                "(at long context they would not fit); compute them on one device with attn_implementation='eager'"
            )
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
        elif kwargs["use_cache"] and cur.doc_start is not None:  # as on one device (PackedDocuments)
            raise packed_documents_cache_error(name)
        return kwargs

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        name = type(module).__name__
        plan, cur = self.plan, self.plan.current
        # The input checks see what every rank of the CP group holds alike: they fail on all of them, reported once
        # (Note [Failures that speak once] in lightning_mtraining.core.errors). Not the position_ids check below:
        # a rank's global positions may equal the positions passed by chance (contiguous layout, rank 0).
        with same_on_ranks_of(plan.group):
            kwargs = self._check_inputs(module, args, kwargs)
        given = kwargs.get("position_ids")
        # packed documents: the batch's own position_ids (per document, for RoPE); else the global positions
        expected = cur.doc_position_ids if cur.doc_start is not None else cur.position_ids
        if given is None:
            kwargs["position_ids"] = expected
        elif given.shape[-1] != cur.local_len or not bool((given == expected).all()):
            raise ValueError(
                f"{name} received position_ids that are neither the tokens' global positions nor the sharded batch's "
                "own position_ids: the document boundaries of a packed sequence are read from the batch when the "
                "strategy shards it. Put position_ids in the batch (packed documents restart them at 0) and pass "
                "the sharded batch's position_ids, or none"
            )
        labels = kwargs.get("labels")
        self._scale_loss = labels is not None
        if labels is None:
            return (), kwargs
        count: Any = None
        if kwargs.get("shift_labels") is None:
            found = cur.targets_for(labels)
            if found is None:  # labels built in training_step: shift them over the CP group
                found = shift_labels_sharded(
                    labels, cur.target_valid, group=plan.group, cp_rank=plan.cp_rank, cp_size=plan.cp_size,
                    layout=plan.layout, block_size=plan.block_size, lengths=cur.lengths, seq_len=cur.seq_len,
                )
            kwargs["shift_labels"], count = found
        num_items = kwargs.get("num_items_in_batch")
        if num_items is None:
            if count is None:  # the user passed shift_labels: count the targets over the group
                local = (kwargs["shift_labels"] != IGNORE_INDEX).sum()
                if plan.cp_size > 1:
                    dist.all_reduce(local, group=plan.group)
                count = int(local)
            num_items = max(count, 1)
        # Each rank's loss is C / N * (its token-loss sum); see Note [Exact losses and gradients].
        kwargs["num_items_in_batch"] = num_items / plan.cp_size
        return (), kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self.plan.end_forward()
        scale, self._scale_loss = self._scale_loss, False
        current = self.plan.current
        if isinstance(output, dict):
            logits = output.get("logits")
        elif isinstance(output, tuple):  # return_dict=False: (loss, logits, ...) with labels, else (logits, ...)
            logits = output[1 if scale else 0] if len(output) > int(scale) else None
        else:
            logits = None
        if isinstance(logits, torch.Tensor) and current is not None:
            tag_shard(logits, current)
        elif current is not None and "_mt_on_logits" in getattr(output, "__dict__", {}):  # fused: tag when made
            output.__dict__["_mt_on_logits"].append(lambda t: tag_shard(t, current))
        if not scale:
            return output
        loss = output.get("loss") if isinstance(output, dict) else (output[0] if isinstance(output, tuple) else None)
        if loss is None:
            return output
        exact = exact_group_loss(loss, self.plan.group, self.plan.cp_size)
        if isinstance(output, dict):
            output["loss"] = exact
            return output
        return (exact, *output[1:])


def _layer_number(module: nn.Module) -> int:
    layer_idx = getattr(module, "layer_idx", None)
    return -1 if layer_idx is None else int(layer_idx)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the Hugging Face models inside ``model``: the modules whose direct child is an attention
    module (:func:`attention_modules`), in model order."""
    layers: list[nn.Module] = []
    for hf_model in find_hf_models(model):
        attention = set(map(id, attention_modules(hf_model)))
        for module in hf_model.modules():
            if any(id(child) in attention for child in module.children()) and module not in layers:
                layers.append(module)
    return layers


def prepare_model(
    model: nn.Module, plan: ContextParallelPlan, layer_sparsity: Callable[[int], Any] | None = None
) -> PreparedModel:
    """Validate ``model`` and switch it to ring attention under ``plan`` (see the module docstring)."""
    validate_model(model)
    return PreparedModel(model, plan, layer_sparsity)
