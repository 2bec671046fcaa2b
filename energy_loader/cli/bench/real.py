"""The bench's real workloads (``llm``, ``vision``): what a batch counts, how batches are compared,
and the contenders that run them.

A real workload reads files made once into a cache folder (:mod:`.data`), so its contenders are
built for one folder: :func:`real_contenders` binds each :class:`~.contender.Contender`'s
``build`` to it (the ``samples`` and ``workload`` arguments the runner passes are then only
checked). The contenders: the plain torch ``DataLoader``, energy_loader, torchdata's
``StatefulDataLoader`` (all in this interpreter), megatron-energon (``vision``: it reads tars),
and MosaicML Streaming and Google Grain, each run in its own venv
(``benchmarks/peer_venvs.sh``), where ``python -m energy_loader bench`` runs them as it runs
everything else: one child process per run, a JSON line back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from . import llm, vision
from .contender import Contender, bound_to_folder, energy_loader_contender, shutdown_workers
from .peer_torchdata import torchdata_contender

__all__ = ["REAL_WORKLOADS", "RealWorkload", "real_contenders"]


@attrs.frozen
class RealWorkload:
    """A file-based workload: default size, what a batch counts, how batches compare."""

    name: str
    size: int
    size_name: str
    unit: str
    count: Callable[[Any], float]
    fingerprint: Callable[[Any], str]
    description: str


REAL_WORKLOADS = {
    "llm": RealWorkload(
        "llm",
        200_000,
        "documents",
        "sequences (2,048 real tokens)",
        llm.count,
        llm.fingerprint,
        "Parquet documents -> byte-level BPE -> 2,048-token sequences -> batches of 8",
    ),
    "vision": RealWorkload(
        "vision",
        20_000,
        "JPEGs",
        "images",
        vision.count,
        vision.fingerprint,
        "WebDataset JPEGs -> Pillow decode -> random resized crop 224 + flip -> batches of 64",
    ),
}


def _ours(workload: str, folder: Path, *, seed_per_sample: bool = True, **options: Any) -> Any:
    from ...loader import SavableDataLoader

    make = llm.llm_pipeline if workload == "llm" else vision.vision_pipeline
    return SavableDataLoader(
        make(folder, seed_per_sample=seed_per_sample), num_workers=2, prefetch_factor=2, **options
    )


def _plain(workload: str, folder: Path, *, stateful: bool = False) -> Any:
    module = llm if workload == "llm" else vision
    return module.plain_loader(folder, stateful=stateful)


def real_contenders(workload: str, folder: Path, venvs: Path | None = None) -> list[Contender]:
    """Every contender of ``workload`` over the data in ``folder``; peers that need their own
    venv run in ``venvs/<peer>`` (default: ``.venv-peers`` of the repository)."""
    if workload not in REAL_WORKLOADS:
        raise ValueError(f"unknown real workload {workload!r} (choose from llm, vision)")
    from .peer_grain import grain_contender
    from .peer_streaming import streaming_contender

    folder = Path(folder)
    # Our loader and torchdata's as the synthetic workloads drive them, built for the folder.
    contenders = [
        Contender(
            "plain",
            build=bound_to_folder(functools.partial(_plain, workload), folder, workload),
            close=shutdown_workers,
            stateful=False,
        ),
        attrs.evolve(
            energy_loader_contender(),
            build=bound_to_folder(functools.partial(_ours, workload), folder, workload),
            close=lambda loader: loader.close(),
        ),
        attrs.evolve(
            torchdata_contender(),
            build=bound_to_folder(
                functools.partial(_plain, workload, stateful=True), folder, workload
            ),
        ),
    ]
    if workload == "vision":
        from .peer_energon import energon_vision_contender

        contenders.append(energon_vision_contender(folder))
    contenders.append(streaming_contender(workload, folder, venvs))
    contenders.append(grain_contender(workload, folder, venvs))
    return contenders
