"""The standard-library corpus and the generated tasks in a pretrained model's own tokens (instead of bytes).

What :func:`~lightning_mtraining.data.corpus.build_stdlib_corpus` and :mod:`lightning_mtraining.data.long_tasks`
take from a Hugging Face tokenizer: :class:`TokenizerPackageEncoder` turns a standard-library package into the model's
tokens, :func:`document_separator_id` is the token packed documents are joined with, :func:`tokenizer_encode` a
picklable ``encode(str) -> list[int]`` without special tokens, :func:`tokenizer_fingerprint` identifies a tokenizer's
output and :func:`corpus_dir_for` is where the corpus in its tokens is built by default. Only the tokenizer object is
used (``get_vocab``, ``encode``, ``__call__``): neither litdata nor transformers is imported here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TokenizerPackageEncoder", "corpus_dir_for", "document_separator_id", "tokenizer_encode",
           "tokenizer_fingerprint"]




def document_separator_id(tokenizer: Any) -> int:
    """The token that ends a packed document: ``<|endoftext|>`` where the vocabulary has it (what GPT-2-style and
    SmolLM tokenizers put between pretraining documents; SmolLM2's GGUF names ``<|im_start|>`` its EOS, a chat
    token), else the tokenizer's EOS token."""
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return int(vocab["<|endoftext|>"])
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError(f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '?')}) has neither "
                     "<|endoftext|> nor an EOS token to separate documents; set tokenizer.eos_token")


class tokenizer_encode:  # noqa: N801 - used as a function: encode = tokenizer_encode(tokenizer)
    """``encode(text) -> list[int]`` with the tokenizer, no special tokens added; picklable (litdata and DataLoader
    workers)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary and class: equal fingerprints give equal tokens."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # merges, normalizer and pre-tokenizer of fast tokenizers
        digest.update(backend.to_str().encode())
    return digest.hexdigest()


class TokenizerPackageEncoder:
    """A package document in a pretrained model's tokens, for ``data.build_stdlib_corpus(encoder=...)``.

    ``encoder(root, files)`` reads each file (UTF-8, undecodable bytes replaced), tokenises ``"# <path>\\n"`` and its
    source with the model's tokenizer (no special tokens), concatenates the files and ends the document with
    :func:`document_separator_id`. Token ids are ``uint16`` when the vocabulary fits (SmolLM2: 49152), else
    ``int32``. ``fingerprint`` (tokenizer hash and format) and ``vocab_size`` identify the build.
    """

    FORMAT = 1  # part of the fingerprint: bump when the document text changes

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.separator = document_separator_id(tokenizer)
        self.vocab_size = len(tokenizer)
        self.dtype = np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        self.fingerprint = f"tokenizer-v{self.FORMAT}-{tokenizer_fingerprint(tokenizer)}"

    def __call__(self, root: str | os.PathLike, files: Sequence[str]) -> np.ndarray:
        texts = [f"# {rel}\n" + (Path(root) / rel).read_bytes().decode("utf-8", "replace") for rel in files]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        flat = [t for piece in ids for t in piece] + [self.separator]
        return np.asarray(flat, dtype=self.dtype)


def corpus_dir_for(tokenizer: Any, base: str | os.PathLike | None = None) -> Path:
    """Where the standard-library corpus in this tokenizer's tokens is built by default:
    ``$MTRAINING_DATA_DIR/stdlib_<fingerprint[:12]>`` (``./data/...`` without the variable; git-ignored)."""
    root = Path(base) if base is not None else Path(os.environ.get("MTRAINING_DATA_DIR", "data"))
    return root / f"stdlib_{tokenizer_fingerprint(tokenizer)[:12]}"
