"""The bench's real workloads (``llm``, ``vision``): what a batch counts, how batches are compared,
and the two contenders of ``python -m energy_loader bench`` that run them.

A real workload reads files made once into a cache folder (:mod:`.data`), so its contenders are
built for one folder: :func:`real_contenders` binds each :class:`~.contender.Contender`'s
``build`` to it (the ``samples`` and ``workload`` arguments the runner passes are then only
checked). The contenders here are the plain torch ``DataLoader`` and energy_loader; the other
libraries' loaders on the same files (torchdata, megatron-energon, MosaicML Streaming, Grain)
are not part of the installed package: the repository's ``benchmarks/bench_peers.py`` adds
them to these two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from . import llm, vision
from .contender import Contender, bound_to_folder, energy_loader_contender, shutdown_workers

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


def _plain(workload: str, folder: Path) -> Any:
    module = llm if workload == "llm" else vision
    return module.plain_loader(folder)


def real_contenders(workload: str, folder: Path) -> list[Contender]:
    """The plain torch ``DataLoader`` and energy_loader on ``workload`` over the data in
    ``folder``, built as the synthetic workloads' contenders are, for that folder."""
    if workload not in REAL_WORKLOADS:
        raise ValueError(f"unknown real workload {workload!r} (choose from llm, vision)")
    folder = Path(folder)
    return [
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
    ]
