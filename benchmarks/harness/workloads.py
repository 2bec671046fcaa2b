"""The workloads beyond the package's reference one, and the two contenders that every bench
compares on them (the plain torch ``DataLoader`` and energy_loader).

- ``large`` (synthetic, as the reference workload of :mod:`energy_loader.cli.bench` is): a
  3 x 224 x 224 uint8 image per sample -> a horizontal flip -> shuffle buffer of 64 -> batch of
  32 (4.8 MB per batch), which the plain loader leaves to the ``DataLoader``'s collate;
- ``llm`` (Parquet documents -> byte-level BPE -> 2,048-token packs -> batches of 8,
  :mod:`.llm`) and ``vision`` (WebDataset JPEGs -> decode -> random resized crop + flip ->
  batches of 64, :mod:`.vision`): real pipelines over files made once into a cache folder
  (:mod:`.data`). Their contenders are built for one folder: :func:`bound_to_folder` binds a
  :class:`~.bench.Contender`'s ``build`` to it (the ``samples`` and
  ``workload`` the runner passes are then only checked).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from energy_loader.cli.bench import WORKLOADS as REFERENCE
from energy_loader.cli.bench import Workload, shutdown_workers

from . import llm, vision
from .bench import Contender, energy_loader_contender

__all__ = ["REAL_WORKLOADS", "WORKLOADS", "RealWorkload", "bound_to_folder", "real_contenders"]

IMAGE_SHAPE = (3, 224, 224)


def make_image(index: int) -> dict[str, Any]:
    """Sample ``index`` of the ``large`` workload: an image whose rows count from ``index``."""
    row = torch.arange(IMAGE_SHAPE[-1], dtype=torch.int32).add_(index).to(torch.uint8)
    return {"index": index, "image": row.expand(IMAGE_SHAPE).contiguous()}


def flip(sample: dict[str, Any]) -> dict[str, Any]:
    """The ``large`` workload's map: a horizontal flip."""
    return {"index": sample["index"], "image": sample["image"].flip(-1)}


# The synthetic workloads, by name.
WORKLOADS = {
    **REFERENCE,
    "large": Workload("large", 6_400, make_image, flip, 64, plain_batches_itself=False),
}


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


def bound_to_folder(build: Callable[..., Any], folder: Any, workload: str) -> Callable[..., Any]:
    """``build(folder, **options)`` as a contender's ``build(samples, workload, **options)``,
    for the file-based workloads: their contenders are made for one data folder, so the
    ``samples`` the runner passes is not used and ``workload`` is only checked."""

    def bound(samples: int, name: str, **options: Any) -> Any:
        if name != workload:
            raise ValueError(f"this contender runs the {workload} workload, not {name!r}")
        return build(folder, **options)

    return bound


def _ours(workload: str, folder: Path, *, seed_per_sample: bool = True, **options: Any) -> Any:
    from energy_loader import SavableDataLoader

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
