"""The Lightning strategies: context parallelism (dense or sparse ring attention) for the Trainer and Fabric.

- :mod:`.options`: :class:`ContextParallelOptions`, the options every strategy shares, documented and checked once.
- :mod:`.common`: what every strategy shares (sizes, mesh, model preparation, batch sharding, output gathering,
  the loss and non-finite checks): :class:`~.common.ContextParallelMixin`.
- :mod:`.trainer`: :class:`MTrainingStrategy` (DDP; ``"mtraining"``, ``"mtraining_dense"``); :mod:`.fsdp`:
  :class:`MTrainingFSDPStrategy` (FSDP2, tensor parallel; ``"mtraining_fsdp"``, ``"mtraining_fsdp_dense"``);
  :mod:`.fabric`: :class:`MTrainingFabricStrategy` (``Fabric(strategy="mtraining")``).
- :mod:`.launchers`: Lightning's process launchers with the checks run before launch and no local rank left running
  after a failure.
- :mod:`.cluster`: from "N machines of G GPUs" to a job: the world each launcher (Lightning Studio, torchrun, SLURM)
  gives the strategy, the node-layout check, a plan as a LightningCLI config, launch commands, Studio jobs.
"""

from lightning_mtraining.strategies.fabric import MTrainingFabricStrategy
from lightning_mtraining.strategies.fsdp import MTrainingFSDPStrategy
from lightning_mtraining.strategies.options import ContextParallelOptions
from lightning_mtraining.strategies.trainer import MTrainingStrategy

__all__ = ["ContextParallelOptions", "MTrainingFSDPStrategy", "MTrainingFabricStrategy", "MTrainingStrategy"]
