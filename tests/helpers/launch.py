"""Launcher environments for the launcher and plan tests: a clean environment (no launcher variable of this process
leaks into a simulated one) and a free port in a range away from the ephemeral ports."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

# Variables any launcher may have left in this process's environment: none may leak into the simulated ones.
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME")
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "PL_")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]))
    return env


def free_port(low: int = 20000, high: int = 30000) -> int:
    """A port in ``[low, high)`` that nothing listens on now."""
    for port in random.Random().sample(range(low, high), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")
