"""The worker-process side of the loader: code that runs inside torch's DataLoader workers.

- :mod:`~energy_loader.workers.side`: the dataset torch iterates in each worker;
- :mod:`~energy_loader.workers.runner`: one logical worker's partitions, round-robin, numbered
  and snapshotted;
- :mod:`~energy_loader.workers.bundling`: several items a trip through torch's queues;
- :mod:`~energy_loader.workers.commands`: the command thread and the orphan exit;
- :mod:`~energy_loader.workers.protocol`: the named types that cross to the main process.

Nothing here imports the main-process side (:mod:`energy_loader.loader`). With
``num_workers=0`` the same runner runs in the main process.
"""

from .protocol import CheckpointSettings, RunPlan, WorkerItem
from .side import WorkerSideDataset

__all__ = ["CheckpointSettings", "RunPlan", "WorkerItem", "WorkerSideDataset"]
