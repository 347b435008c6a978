"""Block ops for tests."""

from __future__ import annotations

from lightning_mtraining.ring.block_ops import TorchBlockOp


class CountingOp(TorchBlockOp):
    """The torch op, counting its ``forward`` and ``backward`` calls (steps that compute nothing never call it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args, **kwargs):
        self.calls["forward"] += 1
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls["backward"] += 1
        return super().backward(*args, **kwargs)
