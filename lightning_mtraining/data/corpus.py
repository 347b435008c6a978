"""Long-context token data: the embedded byte-level corpus, litdata packing, and CP-aware streaming.

Three jobs, in the order data flows:

1. **The embedded default corpus.** The Python standard library's own source files on this machine
   (``sysconfig.get_paths()["stdlib"]``), concatenated by package the way code corpora concatenate
   the files of one repository, tokenised at byte level. Nothing is downloaded, and every machine
   with a Python has it (about 31 MB / 31M tokens on CPython 3.11, 200 "packages": each top-level
   package folder or single module is one document).

   Token ids (``VOCAB_SIZE = 258``)::

       0..255      the raw bytes of the source files (no decoding: every file round-trips exactly)
       256  EOS    ends a package document
       257  FILE   starts a file; followed by its path relative to the stdlib, b"\\n", its bytes

       document(package) = FILE "json/__init__.py\\n" <bytes> FILE "json/decoder.py\\n" <bytes> ... EOS

2. **Packing with litdata.** :func:`build_stdlib_corpus` writes the token stream with
   ``litdata.optimize(..., item_loader=TokensLoader())``: chunks of ``chunk_tokens`` uint16 tokens.
   The sequence length is chosen at READ time (``TokensLoader(block_size=seq_len)`` cuts each chunk
   into consecutive windows of ``seq_len`` tokens that run across document boundaries: packing), so
   one built corpus serves every context length; a chunk's tail shorter than ``seq_len`` is skipped.
   The build is deterministic (sorted files, one writer) and idempotent (a manifest with a content
   fingerprint; a file lock and an atomic rename make concurrent ranks safe).

3. **Context-parallel streaming.** Under context parallelism every rank of one CP group must train on
   the SAME sample (each takes its own shard of the sequence later, in the strategy), and different
   data-parallel groups on different samples. litdata's ``StreamingDataset`` shards by the global
   rank it detects on its own, which would give the CP ranks different samples. We override its
   distributed environment with the data-parallel rank and size::

       world 4 = DP 2 x CP 2         litdata sees            reads
       rank 0: dp 0, cp 0    ->   rank 0 of 2 replicas  ->  samples A, C, E, ...
       rank 1: dp 0, cp 1    ->   rank 0 of 2 replicas  ->  samples A, C, E, ...   (same as rank 0)
       rank 2: dp 1, cp 0    ->   rank 1 of 2 replicas  ->  samples B, D, F, ...
       rank 3: dp 1, cp 1    ->   rank 1 of 2 replicas  ->  samples B, D, F, ...

   Why override rather than "CP rank 0 reads and broadcasts": no collective on the input path (a
   broadcast of [B, S] int64 per step, plus a second process group to keep it off the training
   stream), no rank that reads while the others wait, and the loader stays an ordinary DataLoader
   that works with no process group at all. The cost is that each CP rank reads the sample from
   disk; for a local dataset litdata memory-maps the chunks in place, so the ranks of one node share
   the page cache. Caveat: for a REMOTE ``input_dir`` (s3://...), give each rank its own
   ``cache_dir``, since ranks of one CP group then download and evict the same chunks.

litdata is imported only by this module (it is absent from the GPU image): ``import
lightning_mtraining`` does not import it; ``import lightning_mtraining.data.corpus`` does, and fails with
``ModuleNotFoundError`` where litdata is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import filelock  # a litdata requirement
import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize
from litdata.utilities.env import _DistributedEnv

from lightning_mtraining.core.rng import preserved_rng_states

__all__ = [
    "BYTE_VOCAB",
    "DataParallelStreamingDataLoader",
    "EOS_TOKEN",
    "FILE_TOKEN",
    "VOCAB_SIZE",
    "build_stdlib_corpus",
    "data_parallel_rank_size",
    "decode_tokens",
    "default_corpus_dir",
    "document_position_ids",
    "encode_bytes",
    "encode_package",
    "stdlib_packages",
    "token_dataloader",
    "token_dataset",
]

BYTE_VOCAB = 256
EOS_TOKEN = 256
FILE_TOKEN = 257
VOCAB_SIZE = 258
TOKEN_DTYPE = np.uint16  # 258 ids fit; half the disk and page cache of int32

# Bump when the token format or the file selection changes: it is part of the build fingerprint.
_FORMAT_VERSION = 1
_MANIFEST = "mtraining_corpus.json"
_SPECIAL_NAMES = {EOS_TOKEN: b"<|eos|>", FILE_TOKEN: b"<|file|>"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ---------------------------------------------------------------------------------------------
# Byte-level tokens
# ---------------------------------------------------------------------------------------------


def encode_bytes(data: bytes) -> np.ndarray:
    """Bytes -> uint16 token ids 0..255 (one token per byte)."""
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def decode_tokens(tokens: Any) -> bytes:
    """Token ids -> bytes; specials become ``<|eos|>`` / ``<|file|>`` (for reading samples, not exact)."""
    ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).astype(np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must lie in [0, {VOCAB_SIZE}); got min {ids.min()} max {ids.max()}")
    special = ids >= BYTE_VOCAB
    if not special.any():
        return ids.astype(np.uint8).tobytes()
    out = bytearray()
    start = 0
    for pos in np.flatnonzero(special):
        out += ids[start:pos].astype(np.uint8).tobytes()
        out += _SPECIAL_NAMES[int(ids[pos])]
        start = int(pos) + 1
    out += ids[start:].astype(np.uint8).tobytes()
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# The embedded corpus: the standard library's sources, one document per package
# ---------------------------------------------------------------------------------------------


def stdlib_packages(
    stdlib_dir: str | os.PathLike | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> list[tuple[str, list[str]]]:
    """List ``(package, [relative .py paths, sorted])`` for the stdlib, packages sorted by name.

    A package is a top-level folder (all ``.py`` files below it) or a top-level module (``os`` ->
    ``os.py``). ``site-packages`` and ``__pycache__`` are skipped. ``include`` keeps only the named
    packages (a name that is not there raises); ``exclude`` drops some.
    """
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {str(root)!r} does not exist")
    packages: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(root)):
        path = root / entry
        if path.is_dir() and entry not in _SKIP_DIRS:
            files = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
                rel_dir = Path(dirpath).relative_to(root)
                files += [(rel_dir / f).as_posix() for f in sorted(filenames) if f.endswith(".py")]
            if files:
                packages[entry] = sorted(files)
        elif path.is_file() and entry.endswith(".py"):
            packages[entry[: -len(".py")]] = [entry]
    if include is not None:
        missing = sorted(set(include) - set(packages))
        if missing:
            raise ValueError(f"packages {missing} not found in {str(root)!r}; available: {sorted(packages)[:20]} ...")
        packages = {name: files for name, files in packages.items() if name in set(include)}
    return [(name, files) for name, files in sorted(packages.items()) if name not in set(exclude)]


def encode_package(root: str | os.PathLike, files: Sequence[str]) -> np.ndarray:
    """One package document: ``FILE path \\n bytes`` for each file, then ``EOS`` (uint16 tokens)."""
    parts = []
    for rel in files:
        parts.append(np.array([FILE_TOKEN], dtype=TOKEN_DTYPE))
        parts.append(encode_bytes(rel.encode() + b"\n"))
        parts.append(encode_bytes((Path(root) / rel).read_bytes()))
    parts.append(np.array([EOS_TOKEN], dtype=TOKEN_DTYPE))
    return np.concatenate(parts)


class _PackageEncoder:
    """The per-input function of ``litdata.optimize``: yields a package document in pieces.

    A class (not a closure) so the spawned litdata workers can unpickle it. Pieces of at most
    ``piece_tokens`` keep chunks near their target size: litdata never splits an item across
    chunks, and the 17 MB ``test`` package would otherwise make one oversized chunk.
    """

    def __init__(
        self,
        root: str,
        packages: list[tuple[str, list[str]]],
        piece_tokens: int,
        progress: bool = False,
        started: float = 0.0,
        encoder: Any = None,
    ) -> None:
        self.root = root
        self.packages = packages
        self.piece_tokens = piece_tokens
        self.progress = progress
        self.started = started  # time.time() of the build's start (wall clock: this runs in a worker process)
        self.encoder = encoder
        self._tokens = 0

    def __call__(self, index: int) -> Iterator[np.ndarray]:
        tokens = (self.encoder or encode_package)(self.root, self.packages[index][1])
        self._tokens += len(tokens)
        total = len(self.packages)
        # About ten lines per build: every tenth of the packages, and the last one.
        if self.progress and ((index + 1) % max(1, total // 10) == 0 or index + 1 == total):
            print(
                f"  corpus: {index + 1}/{total} packages, {self._tokens / 1e6:.1f}M tokens, "
                f"{time.time() - self.started:.0f} s",
                flush=True,
            )
        for start in range(0, len(tokens), self.piece_tokens):
            yield tokens[start : start + self.piece_tokens]


def default_corpus_dir() -> Path:
    """``$MTRAINING_DATA_DIR/stdlib_bytes``, default ``./data/stdlib_bytes`` (``/data/`` is git-ignored)."""
    return Path(os.environ.get("MTRAINING_DATA_DIR", "data")) / "stdlib_bytes"


def _fingerprint(root: Path, packages: list[tuple[str, list[str]]], chunk_tokens: int, encoder: Any = None) -> str:
    digest = hashlib.sha256(f"v{_FORMAT_VERSION} chunk_tokens={chunk_tokens}\n".encode())
    if encoder is not None:
        digest.update(f"encoder {encoder.fingerprint}\n".encode())
    for name, files in packages:
        digest.update(f"package {name}\n".encode())
        for rel in files:
            digest.update(f"file {rel}\n".encode())
            digest.update(hashlib.sha256((root / rel).read_bytes()).digest())
    return digest.hexdigest()


def _read_manifest(output_dir: Path) -> dict | None:
    try:
        return json.loads((output_dir / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def build_stdlib_corpus(
    output_dir: str | os.PathLike | None = None,
    *,
    stdlib_dir: str | os.PathLike | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    chunk_tokens: int = 1 << 22,
    force: bool = False,
    verbose: bool = False,
    encoder: Any = None,
) -> Path:
    """Build the byte-level stdlib corpus as litdata chunks under ``output_dir``; return the folder.

    Idempotent: if ``output_dir`` already holds a build with the same fingerprint (format version,
    chunk size, every file's path and content hash) nothing is written. Safe to call from every rank
    at once: a file lock serialises builders, and the build is written to a temporary folder that is
    renamed into place, so readers never see half a corpus. Deterministic: sorted packages and
    files, one litdata worker, ordered writing, so the same sources give byte-identical chunks.
    The caller's random generators are left as they were (litdata's ``optimize`` seeds Python's,
    NumPy's and torch's with 42): a run that builds the corpus draws the same model initialisation
    and data order from its seed as a run that finds it built.

    Args:
        output_dir: where the chunks go (default :func:`default_corpus_dir`).
        stdlib_dir: the source tree (default ``sysconfig.get_paths()["stdlib"]``).
        include, exclude: package selection, see :func:`stdlib_packages` (tests build a small subset).
        chunk_tokens: tokens per litdata chunk (the last ``< seq_len`` tokens of each chunk are
            skipped when reading, so keep it much larger than the context length).
        force: rebuild even if an up-to-date build exists.
        verbose: print progress while building (a line per tenth of the packages; nothing when the
            corpus is already built).
        encoder: the tokens of a package document, for a pretrained model's tokenizer: an object with
            ``__call__(root, files) -> np.ndarray`` (``uint16`` or ``int32`` ids, the document's end token included),
            ``fingerprint`` (a string that changes whenever the tokens would) and ``vocab_size`` (e.g.
            :class:`lightning_mtraining.data.model_tokens.TokenizerPackageEncoder`). None: the byte-level tokens above.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive; got {chunk_tokens}")
    output_dir = Path(output_dir if output_dir is not None else default_corpus_dir()).absolute()
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    packages = stdlib_packages(root, include=include, exclude=exclude)
    if not packages:
        raise ValueError(f"no .py files selected under {str(root)!r} (include={include}, exclude={exclude})")
    fingerprint = _fingerprint(root, packages, chunk_tokens, encoder)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(output_dir) + ".lock"):
        manifest = _read_manifest(output_dir)
        if not force and manifest is not None and manifest.get("fingerprint") == fingerprint:
            return output_dir
        tmp_dir = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        start = time.time()
        num_files = sum(len(files) for _, files in packages)
        if verbose:
            print(
                f"building the {'byte-level' if encoder is None else 'tokenized'} corpus of {len(packages)} "
                f"packages ({num_files} files) from {root} into {output_dir} (once; later runs reuse it)",
                flush=True,
            )
        with preserved_rng_states():
            optimize(
                fn=_PackageEncoder(str(root), packages, piece_tokens=max(1, chunk_tokens // 8), progress=verbose,
                                    started=start, encoder=encoder),
                inputs=list(range(len(packages))),
                output_dir=str(tmp_dir),
                chunk_size=chunk_tokens,
                item_loader=TokensLoader(),
                num_workers=1,
                keep_data_ordered=True,
                reorder_files=False,
                verbose=False,
            )
        index = json.loads((tmp_dir / "index.json").read_text())
        num_tokens = sum(chunk["dim"] for chunk in index["chunks"])
        if verbose:
            print(f"corpus built: {num_tokens / 1e6:.1f}M tokens in {time.time() - start:.0f} s", flush=True)
        manifest = {
            "fingerprint": fingerprint,
            "format_version": _FORMAT_VERSION,
            "stdlib_dir": str(root),
            "python": sys.version.split()[0],
            "vocab_size": VOCAB_SIZE if encoder is None else int(encoder.vocab_size),
            "chunk_tokens": chunk_tokens,
            "num_packages": len(packages),
            "num_files": num_files,
            "num_tokens": num_tokens,
            "packages": [name for name, _ in packages],
        }
        (tmp_dir / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(tmp_dir, output_dir)
    return output_dir


# ---------------------------------------------------------------------------------------------
# Context-parallel streaming
# ---------------------------------------------------------------------------------------------


def data_parallel_rank_size(source: Any = None, *, dp_axis: str | None = None) -> tuple[int, int]:
    """The data-parallel ``(rank, size)`` the loader must shard by.

    ``source`` may be:
      - a Lightning strategy (Trainer or Fabric): its ``distributed_sampler_kwargs`` (``rank``,
        ``num_replicas``), which ``MTrainingStrategy`` sets to the DP rank and size (and DDP to the
        global rank and world size, which is right for DDP);
      - a ``DeviceMesh``: the size and local rank of its data-parallel axis (``dp_axis``, default
        the first of "dp", "data_parallel" present; a 1-D mesh counts as DP);
      - None: (0, 1) when no process group is initialised (single process). With an initialised
        group of more than one rank this raises: silently sharding by the global rank would give
        the ranks of one CP group different samples. Pass the DP rank/size explicitly instead.
    """
    if source is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                raise ValueError(
                    "a process group of world size "
                    f"{torch.distributed.get_world_size()} is initialised but no data-parallel rank/size was "
                    "given: pass `strategy=` (e.g. `self.trainer.strategy`), a device mesh, or "
                    "`dp_rank=`/`dp_size=` (ranks of one context-parallel group must read the same samples)"
                )
        return 0, 1
    if hasattr(source, "mesh_dim_names") and hasattr(source, "get_local_rank"):
        names = tuple(source.mesh_dim_names or ())
        if dp_axis is None:
            candidates = [n for n in ("dp", "data_parallel") if n in names]
            if candidates:
                dp_axis = candidates[0]
            elif source.ndim == 1:
                return source.get_local_rank(), source.size()
            else:
                raise ValueError(f"device mesh axes {names} have no 'dp'/'data_parallel' axis; pass dp_axis=")
        return source.get_local_rank(dp_axis), source.size(names.index(dp_axis))
    kwargs = getattr(source, "distributed_sampler_kwargs", None)
    if kwargs is None:
        # Single-device strategies (SingleDeviceStrategy) have no sampler kwargs.
        return 0, 1
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


class _ToTrainingSample:
    """litdata item (uint16 window of ``seq_len`` tokens) -> ``{"input_ids", "labels"}`` int64, and with
    ``documents`` also ``position_ids`` that restart at 0 after every ``EOS_TOKEN`` (packed documents).

    ``labels`` equals ``input_ids``: the causal-LM shift happens in the model (single device) or
    globally before sharding (the strategy), never here. Module-level class: workers unpickle it.
    """

    def __init__(self, documents: bool = False, eos_token: int = EOS_TOKEN) -> None:
        self.documents = documents
        self.eos_token = eos_token

    def __call__(self, item: Any) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(np.asarray(item).astype(np.int64))
        sample = {"input_ids": tokens, "labels": tokens.clone()}
        if self.documents:
            sample["position_ids"] = document_position_ids(tokens, self.eos_token)
        return sample


def document_position_ids(tokens: torch.Tensor, eos_token: int = EOS_TOKEN) -> torch.Tensor:
    """Positions that restart at 0 on the token after each ``eos_token`` (default ``EOS_TOKEN``; a document's end token
    belongs to it), counted from 0 at the window's start: ``tokens [..., S]`` -> int64 of the same shape. What packing
    pipelines give a model so that packed documents attend only within themselves
    (:func:`~lightning_mtraining.core.layouts.document_starts` reads them back)."""
    idx = torch.arange(tokens.shape[-1], device=tokens.device).expand(tokens.shape)
    new = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    new[..., 1:] = tokens[..., :-1] == eos_token
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start


def token_dataset(
    input_dir: str | os.PathLike,
    seq_len: int,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    shuffle: bool = True,
    seed: int = 42,
    cache_dir: str | None = None,
    documents: bool = False,
    eos_token: int = EOS_TOKEN,
) -> Any:
    """A litdata ``StreamingDataset`` of packed ``seq_len``-token windows, sharded by DATA-PARALLEL rank.

    Every rank given the same ``(dp_rank, dp_size, seed)`` yields the same samples in the same order
    (the ranks of one CP group); different ``dp_rank`` give disjoint samples, the same number each
    (``drop_last`` when ``dp_size > 1``, so no rank runs out first and hangs a collective).
    Items are ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``: a window runs across the
    corpus' document (package) boundaries and every token attends to all earlier tokens of the window. With
    ``documents=True`` items also hold ``position_ids`` that restart after each ``EOS_TOKEN``
    (:func:`document_position_ids`): each package attends only within itself and no label crosses into the next
    one, on one device (the model's own attention, see ``parallel.PackedDocuments``) and under context
    parallelism (the ring masks documents, the strategy reads them from the batch). ``eos_token``: the id that
    ends a document (a corpus in a pretrained model's tokens ends its documents with that tokenizer's separator).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive; got {seq_len}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size; got dp_rank={dp_rank}, dp_size={dp_size}")
    dataset = StreamingDataset(
        str(input_dir),
        cache_dir=cache_dir,
        item_loader=TokensLoader(block_size=seq_len),
        shuffle=shuffle,
        # None, not False, for dp_size 1: litdata warns about drop_last=False under a process group.
        drop_last=True if dp_size > 1 else None,
        seed=seed,
        transform=_ToTrainingSample(documents, eos_token),
    )
    # The override (see the module docstring): litdata detected the GLOBAL rank/world at
    # construction; it reads `distributed_env` when assigning chunks to ranks in `__iter__` and
    # `__len__`. One "node": chunk-to-node affinity is a download-cache optimisation that does not
    # apply to DP groups that span nodes.
    dataset.distributed_env = _DistributedEnv(world_size=dp_size, global_rank=dp_rank, num_nodes=1)
    dataset.set_drop_last(dp_size > 1)
    if len(dataset) == 0:
        raise ValueError(
            f"{str(input_dir)!r} holds no complete window of seq_len={seq_len} tokens for dp_rank {dp_rank} of "
            f"{dp_size}: use a shorter seq_len or a corpus with larger chunks"
        )
    return dataset


def token_dataloader(
    input_dir: str | os.PathLike,
    seq_len: int,
    batch_size: int = 1,
    *,
    strategy: Any = None,
    mesh: Any = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    num_workers: int = 0,
    shuffle: bool = True,
    seed: int = 42,
    cache_dir: str | None = None,
    documents: bool = False,
    eos_token: int = EOS_TOKEN,
) -> Any:
    """A litdata ``StreamingDataLoader`` over :func:`token_dataset`, CP-aware.

    The data-parallel rank/size come from exactly one of: ``strategy`` (a Lightning strategy, e.g.
    ``self.trainer.strategy`` inside ``train_dataloader``), ``mesh`` (a device mesh with a DP axis),
    or ``dp_rank``/``dp_size``; with none of them, single process only (see
    :func:`data_parallel_rank_size`). Batches are ``{"input_ids", "labels"}`` of shape
    ``[batch_size, seq_len]`` (and ``position_ids`` with ``documents=True``: packed documents, see
    :func:`token_dataset`), FULL sequences: sharding along the sequence is the strategy's job.
    The loader increments its epoch on every new iteration, so a shuffled corpus is reshuffled.
    """
    given = [name for name, value in (("strategy", strategy), ("mesh", mesh)) if value is not None]
    if dp_rank is not None or dp_size is not None:
        if dp_rank is None or dp_size is None:
            raise ValueError(f"pass both dp_rank and dp_size; got dp_rank={dp_rank}, dp_size={dp_size}")
        given.append("dp_rank/dp_size")
    if len(given) > 1:
        raise ValueError(f"pass only one of strategy, mesh, dp_rank/dp_size; got {given}")
    if dp_rank is None or dp_size is None:
        dp_rank, dp_size = data_parallel_rank_size(strategy if strategy is not None else mesh)
    dataset = token_dataset(
        input_dir, seq_len, dp_rank=dp_rank, dp_size=dp_size, shuffle=shuffle, seed=seed, cache_dir=cache_dir,
        documents=documents, eos_token=eos_token,
    )
    return DataParallelStreamingDataLoader(
        dataset, batch_size=batch_size, num_workers=num_workers, drop_last=dp_size > 1
    )


class DataParallelStreamingDataLoader(StreamingDataLoader):
    """litdata's ``StreamingDataLoader`` for a dataset whose distributed environment is the DP one.

    One fix, for resuming from a checkpoint (Lightning saves and restores a loader's ``state_dict``):
    ``StreamingDataLoader.load_state_dict`` compares the checkpoint's world size, which the dataset
    recorded from its (data-parallel) environment, with the GLOBAL world size it detects itself.
    Under context parallelism those differ, litdata takes the checkpoint for a topology change,
    restarts its own sample counter at 0, and the NEXT checkpoint then resumes at the wrong sample.
    Here the comparison sees the world size it expects, and the dataset (which checks against its
    own DP environment) receives the checkpoint unchanged.
    """

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        ds_state = obj.get("dataset") if isinstance(obj, dict) else None
        ours = getattr(getattr(self.dataset, "distributed_env", None), "world_size", None)
        detected = _DistributedEnv.detect().world_size
        if (
            isinstance(ds_state, dict)
            and ours is not None
            and detected != ours
            and int(ds_state.get("world_size", ours)) == ours
        ):
            super().load_state_dict({**obj, "dataset": {**ds_state, "world_size": detected}})
            self.dataset.load_state_dict(ds_state)
        else:
            super().load_state_dict(obj)
