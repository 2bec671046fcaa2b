"""Rank programs for tests/test_dcp_scale.py (launched by tests/distributed_helpers.launch).

Each program runs on every rank of a gloo group, writes what it saw to the work directory and
leaves the judging to the test: a DCP save through :class:`energy_loader.dcp.SavePlanner` (and
torch's default planner, for comparison), loads into fresh loaders of other partition counts,
and a load whose metadata only the coordinator reads.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import energy_loader as el
from energy_loader.testing.storage import CountingReader
from tests.distributed_helpers import save_json
from tests.helpers import reference_pipeline

LENGTH = 960  # samples: every partition count used here reads a few batches of its own


def outcome(call: Any) -> list[str]:
    """``["ok", ""]`` or ``[exception class name, message]``; DCP's ``CheckpointException``
    derives from ``BaseException``, so it is caught too."""
    try:
        call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:
        return [type(error).__name__, str(error)]
    return ["ok", ""]


def small_loader(num_partitions: int | None) -> el.SavableDataLoader:
    """A reference-like pipeline, no workers (many ranks share two cores)."""
    config = el.WorkerConfig.from_process_group(num_workers=0, seed=3)
    return el.SavableDataLoader(
        reference_pipeline(length=LENGTH, buffer=8, batch=4),
        worker_config=config,
        num_partitions=num_partitions,
    )


def save_both_ways(
    rank: int, world_size: int, workdir: Path, *, partitions: int, steps: int, more: int
) -> None:
    """Take ``steps`` batches, save the loader with energy_loader's save planner to ``dcp/``
    and with torch's default one to ``dcp_default/``, then record the next ``more`` batches'
    keys (the stream a restore must continue)."""
    from energy_loader import dcp as el_dcp

    loader = small_loader(partitions)
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    dcp.save({"loader": loader}, checkpoint_id=workdir / "dcp", planner=el_dcp.SavePlanner())
    dcp.save({"loader": loader}, checkpoint_id=workdir / "dcp_default")
    keys = [next(iterator)["__restore_key__"] for _ in range(more)]
    torch.save(keys, workdir / f"saved{rank}.pt")
    loader.close()


def load_other_counts(
    rank: int,
    world_size: int,
    workdir: Path,
    *,
    cases: list[tuple[int | None, bool | str]],
    steps: int,
) -> None:
    """Load ``dcp/`` into fresh loaders, one per case ``(num_partitions, ours)``
    (``None``: built without ``num_partitions``; ``ours``: energy_loader's load planner, else
    torch's default; ``"load"``: torch's default through ``energy_loader.dcp.load``); record
    each outcome under ``"<count>/<ours>"`` and, when it loaded, the next ``steps`` batches'
    keys. Last, a load of a missing checkpoint through a SharedMetadataReader
    (``"missing"``): every rank must raise, none wait."""
    from energy_loader import dcp as el_dcp

    report: dict[str, Any] = {}
    for count, ours in cases:
        loader = small_loader(count)
        kwargs = {"planner": el_dcp.LoadPlanner()} if ours is True else {}
        load = el_dcp.load if ours == "load" else dcp.load
        result = outcome(
            functools.partial(load, {"loader": loader}, checkpoint_id=workdir / "dcp", **kwargs)
        )
        keys = []
        if result[0] == "ok":
            iterator = iter(loader)
            keys = [next(iterator)["__restore_key__"] for _ in range(steps)]
        report[f"{count}/{ours}"] = {"outcome": result, "keys": keys}
        loader.close()
        dist.barrier()  # every rank done with this case before the next load
    loader = small_loader(None)
    reader = el_dcp.SharedMetadataReader(FileSystemReader(workdir / "missing"))
    report["missing"] = {
        "outcome": outcome(functools.partial(dcp.load, {"loader": loader}, storage_reader=reader))
    }
    loader.close()
    save_json(workdir / f"other_counts_rank{rank}.json", report)


def load_sharing_metadata(
    rank: int, world_size: int, workdir: Path, *, partitions: int, steps: int
) -> None:
    """Load ``dcp/`` through a SharedMetadataReader over a counting reader: record this rank's
    bytes (``.metadata`` and data) and the next ``steps`` batches' keys."""
    from energy_loader import dcp as el_dcp

    loader = small_loader(partitions)
    counting = CountingReader(workdir / "dcp")
    dcp.load(
        {"loader": loader},
        storage_reader=el_dcp.SharedMetadataReader(counting),
        planner=el_dcp.LoadPlanner(),
    )
    iterator = iter(loader)
    keys = [next(iterator)["__restore_key__"] for _ in range(steps)]
    torch.save(keys, workdir / f"shared{rank}.pt")
    save_json(
        workdir / f"shared_rank{rank}.json",
        {"metadata": counting.metadata_bytes, "data": counting.data_bytes},
    )
    loader.close()
