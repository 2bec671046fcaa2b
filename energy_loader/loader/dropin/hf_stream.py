"""A Hugging Face ``datasets.IterableDataset`` given to the drop-in loader on several ranks.

torch's loader does not split an iterable dataset between ranks: the dataset must read its
rank's part itself. A Hugging Face stream does so once split with
``datasets.distributed.split_dataset_by_node(stream, rank=rank, world_size=world_size)``;
unsplit, every rank reads the whole stream, so every row is trained once per rank, and
ranks whose streams end at different steps fall out of step in their collectives and hang.
The drop-in loader refuses such a stream when it is built (the layout is the loader's
``worker_config``: an initialised process group or torchrun's variables), and a stream split
for another layout.
"""

from __future__ import annotations

import sys
from typing import Any

from ...worker import WorkerConfig


def check_stream_split(dataset: Any, config: WorkerConfig) -> None:
    """Raise ``ValueError`` for a Hugging Face stream not split for this rank of ``config``."""
    module = sys.modules.get("datasets")  # not imported: no Hugging Face stream here
    if module is None or not isinstance(dataset, module.IterableDataset):
        return
    # split_dataset_by_node records its split here; the datasets package has no public getter
    split = getattr(dataset, "_distributed", None)
    if split is None:
        if config.world_size > 1:
            raise ValueError(
                f"this datasets.IterableDataset is read by rank {config.rank} of "
                f"{config.world_size} but not split between the ranks: every rank would read "
                "the whole stream (each row trained once per rank, and ranks whose streams "
                "end at different steps hang in their collectives). Split it first: "
                "datasets.distributed.split_dataset_by_node(stream, rank=rank, "
                "world_size=world_size)"
            )
        return
    if (split.rank, split.world_size) != (config.rank, config.world_size):
        raise ValueError(
            "this datasets.IterableDataset was split with split_dataset_by_node for rank "
            f"{split.rank} of {split.world_size}, but the loader runs as rank {config.rank} of "
            f"{config.world_size} (its worker_config, from the process group or torchrun's "
            "variables): split it with this process's rank and world size, or pass "
            "worker_config=WorkerConfig(rank=..., world_size=..., num_workers=...)"
        )
