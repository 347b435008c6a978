"""The options every mtraining strategy shares, described and validated in one place.

:class:`ContextParallelOptions` is the single description of what the Trainer strategy
(:class:`~lightning_mtraining.strategies.trainer.MTrainingStrategy`), the FSDP2 Trainer strategy
(:class:`~lightning_mtraining.strategies.fsdp.MTrainingFSDPStrategy`) and the Fabric strategy
(:class:`~lightning_mtraining.strategies.fabric.MTrainingFabricStrategy`) accept about context parallelism: each field's
type, default, documentation and validation. The strategies keep explicit keyword arguments (LightningCLI, jsonargparse
and IDEs read a class's signature), collect them with :meth:`ContextParallelOptions.from_arguments`, and append the
fields' documentation to their docstrings with :func:`options_doc`. ``tests/unit/test_options.py`` checks that every
strategy's signature carries every field it should, with the same default. To add an option: a field here (with its
entry in :data:`FIELD_DOCS` and its check in ``__post_init__``), then the keyword in each strategy's signature; the test
names any strategy that lacks it.

No Lightning import here: the plain-torch path (:func:`~lightning_mtraining.hf.parallel.apply_context_parallel`) may use
the same checks.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from typing import Any, Literal

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.core.layouts import LAYOUTS
from lightning_mtraining.hf.losses import FUSED_LOSS_BACKENDS
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig, parse_sparsity

__all__ = ["ContextParallelOptions", "FIELD_DOCS", "FSDP_ONLY", "LOSS_CHECKS", "OPTIONS_MARKER", "TRAINER_ONLY",
           "document_options", "options_doc"]

LOSS_CHECKS = ("raise", "warn", "off")

# The line of a strategy's docstring that :func:`document_options` replaces with the fields' documentation.
OPTIONS_MARKER = "(the ContextParallelOptions fields, rendered here by document_options)"

# Options that only the Trainer strategies accept: Fabric returns the step's outputs as the user's code made them
# (nothing to gather), and offloads where the user runs the forward (``torch.autograd.graph.save_on_cpu``).
TRAINER_ONLY = ("gather_outputs", "offload_activations")

# Options of the N-dimensional mesh (:mod:`lightning_mtraining.distributed.mesh`) that only the FSDP2 strategy accepts:
# tensor parallel layers are DTensors, which DDP does not reduce, and HSDP is FSDP2's.
FSDP_ONLY = ("tensor_parallel_size", "data_parallel_replicate_size")

FIELD_DOCS: dict[str, str] = {
    "context_parallel_size": (
        "ranks that share one sequence; ``\"auto\"`` = all ranks. Must divide the world (``num_nodes x devices``); "
        "the quotient is the data-parallel size."),
    "inner_ring_size": (
        "ranks of one inner ring of hierarchical ring attention; ``None``: a flat ring when each CP group lies "
        "inside a node, else inner rings as large as fit inside a node (one node's ranks when a CP group spans whole "
        "nodes), so only the outer ring crosses nodes; rank 0's mesh line says where each ring runs."),
    "layout": "token layout of the shards (``\"striped\"`` balances causal and vertical-slash work).",
    "block_size": "block of the striped layout (sequences are padded to ``cp_size x block_size``).",
    "sparsity": (
        "vertical-slash budgets for sparse ring attention (the pattern is estimated online for every layer and "
        "forward, :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`), or ``None`` for dense (exact) "
        "attention, or the same as a short string: ``\"paper\"``, ``\"none\"``, ``\"topp:P\"`` or ``\"topk:V,S\"``, "
        "each with an optional ``\"@T\"`` for T-token tiles (default 128) "
        "(:func:`~lightning_mtraining.sparsity.config.parse_sparsity`: the same in every entry point). "
        "The default is the paper's training setting, :data:`~lightning_mtraining.sparsity.config."
        "PAPER_SPARSITY` (top-p 0.9, caps 4096), which is what ``strategy=\"mtraining\"`` means; "
        "``strategy=\"mtraining_dense\"`` is ``sparsity=None``. Top-p keeps every tile of the short sequences one "
        "tries first (1-8K tokens) when the model's attention is spread out (random initialisation): such a run logs "
        "once that it trains at dense cost, and what to do. Per-layer overrides and the logged density and imbalance: "
        ":class:`~lightning_mtraining.callbacks.sparse_attention.SparseAttentionCallback`."),
    "loss_check": (
        "what to do when the loss reaching backward did not come through a sharding-aware path "
        "(``model(**batch).loss``, :func:`~lightning_mtraining.hf.losses.causal_lm_loss`) while the sequence is split: "
        "``\"raise\"`` (default), ``\"warn\"`` (once) or ``\"off\"``; see Note [Checking the loss] in "
        ":mod:`lightning_mtraining.hf.losses`."),
    "fused_loss": (
        "a model called with labels computes its loss from the hidden states a chunk of rows at a time and never "
        "materialises the ``[B, L, vocab]`` logits unless the step reads ``out.logits``; for the model types in "
        ":data:`~lightning_mtraining.hf.fused_loss.FUSED_LOSS_MODEL_TYPES`, others keep the plain loss. See Note "
        "[Fused loss] in :mod:`lightning_mtraining.hf.fused_loss`. ``False``: the model's own loss. A backend name "
        "picks the implementation: ``\"auto\"`` (what ``True`` means: Liger-Kernel on CUDA where it is installed and "
        "applies, else the torch one), ``\"torch\"`` or ``\"liger\"`` (see "
        ":func:`~lightning_mtraining.hf.losses.fused_linear_cross_entropy`)."),
    "activation_checkpointing": (
        "recompute each decoder layer in backward (Hugging Face ``gradient_checkpointing_enable``, non-reentrant): "
        "activations kept per layer are its input only."),
    "tiled_mlp": (
        "compute each decoder layer's MLP this many tokens (of a rank's shard) at a time, each chunk recomputed in "
        "backward, so the MLP's ``[B, tokens, intermediate]`` activations never exist for the whole sequence (Note "
        "[Tiled MLP] in :mod:`lightning_mtraining.hf.tiled_mlp`); for the longest sequences, with "
        "``activation_checkpointing`` and ``offload_activations``. ``None`` (default): the MLP as it is. Results equal "
        "the untiled MLP up to rounding. The loss is tiled already by ``fused_loss``."),
    "nonfinite_check": (
        "``\"raise\"`` (default): a NaN or infinite loss on any rank stops the run before backward with a "
        "``FloatingPointError`` naming where the forward first stopped being finite (the first attention layer whose "
        "input hidden states were non-finite, or that produced them); ``\"warn\"`` warns once and trains on (a "
        "float16 grad scaler skips such steps); ``\"off\"``. Costs two reductions per layer, one host sync and one "
        "all-reduce of a flag per step."),
    "compile": (
        "compile every decoder layer of the Hugging Face models with ``torch.compile`` once they are prepared "
        "(:func:`~lightning_mtraining.hf.compile.compile_decoder_layers`: each layer in place, as torchtitan compiles "
        "its blocks; the embeddings, the loss and the hooks stay eager). ``True``: torch's defaults; a dict: "
        "``torch.compile`` keyword arguments, e.g. ``{\"fullgraph\": True}``. "
        "Ring attention, the pattern estimator and the sparse ring are custom ops inside a compiled layer, so "
        "``fullgraph=True`` holds; the density and imbalance metrics are measured in eager forwards only."),
    "gather_outputs": (
        "(Trainer) return the outputs of ``validation_step``, ``test_step`` and ``predict_step`` whole (tensors "
        "holding this rank's shard of the sequence are gathered, put in global order and unpadded; see "
        ":meth:`~lightning_mtraining.strategies.common.ContextParallelMixin.gather_outputs`); ``False`` leaves them "
        "as shards."),
    "offload_activations": (
        "(Trainer) keep the tensors saved for backward during ``training_step`` in pinned host memory: ``True`` all "
        "of them (like ``torch.autograd.graph.save_on_cpu``), an int N those of the first N decoder layers (and the "
        "embeddings), the rest on the device, so the split can follow the host's memory (Note [Offloading some "
        "layers] in :mod:`lightning_mtraining.hf.offload`). With ``activation_checkpointing`` a layer saves only its "
        "input, so GPU activation memory no longer grows with the offloaded depth. Costs host-device copies each "
        "step. With Fabric, run the forward under ``ActivationOffload(model, N)()``."),
    "tensor_parallel_size": (
        "(FSDP2) ranks that split each decoder layer's heads and MLP columns (torch's ``parallelize_module`` with "
        "the model's ``base_model_tp_plan``, Note [Tensor parallel attention] in "
        ":mod:`lightning_mtraining.hf.tensor_parallel`); the innermost mesh axis. Heads, KV heads and the MLP's "
        "intermediate size must be divisible by it. Embeddings, norms and the output layer stay replicated."),
    "data_parallel_replicate_size": (
        "(FSDP2) data-parallel replicas of the FSDP2 shards (HSDP): parameters are sharded over "
        "``world / (data_parallel_replicate_size x tensor_parallel_size)`` ranks (the dp-shard x cp ranks) and "
        "replicated over this many; the outermost mesh axis."),
}


@dataclasses.dataclass(frozen=True)
class ContextParallelOptions:
    """Context-parallel options shared by the mtraining strategies (documentation: :data:`FIELD_DOCS`, rendered
    into each strategy's docstring by :func:`options_doc`). Constructing one validates every field; errors name the
    owner (``owner=``, e.g. the strategy class), the field and the value."""

    context_parallel_size: int | Literal["auto"] = "auto"
    inner_ring_size: int | None = None
    layout: Literal["striped", "zigzag", "contiguous"] = "striped"
    block_size: int = 128
    sparsity: SparsityConfig | str | None = PAPER_SPARSITY
    loss_check: Literal["raise", "warn", "off"] = "raise"
    fused_loss: bool | str = True
    activation_checkpointing: bool = False
    tiled_mlp: int | None = None
    nonfinite_check: Literal["raise", "warn", "off"] = "raise"
    compile: bool | dict[str, Any] = False
    gather_outputs: bool = True
    offload_activations: bool | int = False
    tensor_parallel_size: int = 1
    data_parallel_replicate_size: int = 1
    owner: str = dataclasses.field(default="ContextParallelOptions", compare=False, repr=False)

    def __post_init__(self) -> None:
        o = self.owner
        cp = self.context_parallel_size
        if cp != "auto" and not is_int(cp):
            raise ValueError(f"{o}(context_parallel_size=...) must be 'auto' or a positive int, got {cp!r}")
        inner = self.inner_ring_size
        if inner is not None and not is_int(inner):
            raise ValueError(f"{o}(inner_ring_size=...) must be None or a positive int, got {inner!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{o}(layout=...) must be one of {LAYOUTS}, got {self.layout!r}")
        if not is_int(self.block_size):
            raise ValueError(f"{o}(block_size=...) must be a positive int, got {self.block_size!r}")
        if isinstance(self.sparsity, str):  # "paper", "none", "topp:P", "topk:V,S": stored as the config they name
            try:
                object.__setattr__(self, "sparsity", parse_sparsity(self.sparsity))
            except ValueError as error:
                raise ValueError(f"{o}(sparsity=...): {error}") from None
        if self.sparsity is not None and not isinstance(self.sparsity, SparsityConfig):
            raise TypeError(f"{o}(sparsity=...) must be a SparsityConfig, a spec string such as 'paper', or None, got "
                            f"{type(self.sparsity).__name__}")
        for name in ("loss_check", "nonfinite_check"):
            if getattr(self, name) not in LOSS_CHECKS:
                raise ValueError(f"{o}({name}=...) must be one of {LOSS_CHECKS}, got {getattr(self, name)!r}")
        if not isinstance(self.fused_loss, bool) and self.fused_loss not in FUSED_LOSS_BACKENDS:
            raise TypeError(f"{o}(fused_loss=...) must be True, False or a backend name {FUSED_LOSS_BACKENDS}, got "
                            f"{self.fused_loss!r}")
        if not isinstance(self.compile, (bool, dict)) or (isinstance(self.compile, dict) and not all(
                isinstance(key, str) for key in self.compile)):
            raise TypeError(f"{o}(compile=...) must be True, False or a dict of torch.compile keyword arguments, got "
                            f"{self.compile!r}")
        if self.tiled_mlp is not None and not is_int(self.tiled_mlp):
            raise ValueError(f"{o}(tiled_mlp=...) must be None or a positive int (tokens per chunk), got "
                             f"{self.tiled_mlp!r}")
        for name in FSDP_ONLY:
            size = getattr(self, name)
            if not is_int(size):
                raise ValueError(f"{o}({name}=...) must be a positive int, got {size!r}")
        offload = self.offload_activations
        if not isinstance(offload, bool) and not is_int(offload):
            raise TypeError(f"{o}(offload_activations=...) must be True, False or a number of decoder layers >= 1, "
                            f"got {offload!r}")
        for name in ("activation_checkpointing", "gather_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{o}({name}=...) must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names (without ``owner``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "owner")

    @classmethod
    def from_arguments(cls, owner: str, arguments: Mapping[str, Any]) -> ContextParallelOptions:
        """The options among a strategy's arguments (``locals()`` of its ``__init__``); absent fields keep their
        defaults (Fabric has no ``gather_outputs`` / ``offload_activations``)."""
        return cls(owner=owner, **{name: arguments[name] for name in cls.field_names() if name in arguments})


def options_doc(indent: int = 8, exclude: tuple[str, ...] = ()) -> str:
    """The shared options as a Google-style ``Args`` block, for a strategy's docstring."""
    lines = []
    for name in ContextParallelOptions.field_names():
        if name in exclude:
            continue
        text = textwrap.fill(f"{name}: {FIELD_DOCS[name]}", width=116 - indent, subsequent_indent="    ")
        lines.append(textwrap.indent(text, " " * indent))
    return "\n".join(lines)


def document_options(cls: type | None = None, *, exclude: tuple[str, ...] = ()) -> Any:
    """Class decorator: replace the line holding :data:`OPTIONS_MARKER` in ``cls.__doc__`` with
    :func:`options_doc` at that line's indentation (so ``help(MTrainingStrategy)`` and the API docs list every
    shared option, written once in :data:`FIELD_DOCS`). ``@document_options(exclude=TRAINER_ONLY)`` leaves out
    fields the class does not accept."""
    if cls is None:
        return lambda c: document_options(c, exclude=exclude)
    doc = cls.__doc__ or ""
    lines = doc.split("\n")
    for i, line in enumerate(lines):
        if OPTIONS_MARKER in line:
            lines[i] = options_doc(len(line) - len(line.lstrip()), exclude)
            cls.__doc__ = "\n".join(lines)
            return cls
    raise ValueError(f"{cls.__name__}'s docstring has no line {OPTIONS_MARKER!r}")
