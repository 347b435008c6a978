"""Leave the caller's random number generators where they were, around code that would move them.

Two places need it: Lightning's DDP setup re-seeds every generator from ``PL_GLOBAL_SEED`` (so that spawned
ranks agree), which on one device makes the first shuffle differ from ``strategy="auto"``; and litdata's
``optimize`` seeds every generator with 42, which made the run that builds the corpus initialise its model
differently from every later run with the same seed.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["preserved_rng_states"]


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's (CPU and initialised CUDA) generator states on exit."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
