"""Other libraries' loaders on the bench's workloads, each written the way its own docs show:
torchdata's ``StatefulDataLoader`` (:mod:`.peer_torchdata`), megatron-energon's
``SavableDataLoader`` (:mod:`.peer_energon`), MosaicML Streaming (:mod:`.peer_streaming`) and
Google Grain (:mod:`.peer_grain`).

They are :class:`~benchmarks.harness.bench.Contender` s like the two that
``python -m energy_loader bench`` compares, kept here, beside the package rather than in it,
so that the installed library carries no adapters of other libraries. ``benchmarks/bench_peers.py``
runs them next to energy_loader and the plain DataLoader in one run. torchdata and
megatron-energon install with the ``bench`` extra; Streaming and Grain conflict with our
requirements and run in venvs of their own (``benchmarks/peer_venvs.sh``, :mod:`.venvs`).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.bench import Contender

from .peer_energon import energon_contender, energon_vision_contender
from .peer_grain import grain_contender
from .peer_streaming import streaming_contender
from .peer_torchdata import torchdata_contender, torchdata_real_contender

__all__ = ["peer_contenders"]


def peer_contenders(
    workload: str, folder: Path | None, venvs: Path | None = None
) -> list[Contender]:
    """The peers of ``workload``, in table order. Synthetic workloads (``folder`` is None):
    torchdata and energon over the workload's pipeline. Real ones, over ``folder``'s data:
    torchdata, energon (``vision`` only: it reads tars, not Parquet), Streaming and Grain, the
    last two run in ``venvs/<peer>`` (default: the repository's ``.venv-peers``)."""
    if folder is None:
        return [torchdata_contender(), energon_contender()]
    peers = [torchdata_real_contender(workload, folder)]
    if workload == "vision":
        peers.append(energon_vision_contender(folder))
    return [
        *peers,
        streaming_contender(workload, folder, venvs),
        grain_contender(workload, folder, venvs),
    ]
