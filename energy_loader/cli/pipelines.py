"""For the commands that rebuild a saved job: ``--pipeline``'s function and a loader from it."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..dataset import SavableDataset


def load_builder(spec: str) -> Callable[[], Any]:
    """The function named by ``module:function`` (the current directory is importable)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--pipeline must be module:function (got {spec!r})")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    function: Any = importlib.import_module(module_name)
    for part in name.split("."):
        function = getattr(function, part)
    if not callable(function):
        raise TypeError(f"{spec} is not callable")
    return function


def check_rank(rank: int, world_size: int) -> None:
    """``ValueError`` unless ``rank`` is a rank of a saved job of ``world_size`` ranks."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"--rank {rank}: the checkpoint was saved by a job of {world_size} rank(s), "
            f"ranks 0 to {world_size - 1}"
        )


def build_loader(built: Any, state: dict[str, Any], rank: int, seed: int | None) -> Any:
    """A loader (never started) with the saved layout, for ``rank``, over the built pipeline."""
    from ..loader import SavableDataLoader
    from ..worker import WorkerConfig

    if isinstance(built, SavableDataLoader):
        pipeline, config_seed = built.pipeline, built.worker_config.seed
        built.close()
    elif isinstance(built, SavableDataset):
        pipeline, config_seed = built, 0
    else:
        raise TypeError(
            "the --pipeline function must return a SavableDataset pipeline or a "
            f"SavableDataLoader (got {type(built).__name__})"
        )
    check_rank(rank, int(state["world_size"]))
    config = WorkerConfig(
        rank=rank,
        world_size=int(state["world_size"]),
        num_workers=int(state["num_workers"]),
        seed=config_seed if seed is None else seed,
    )
    return SavableDataLoader(
        pipeline,
        worker_config=config,
        num_partitions=int(state["num_partitions"]),
        stall_warning=False,
    )
