"""``torch.distributed.checkpoint`` (DCP) at many ranks: two planners and a storage reader.

A loader goes into DCP as it is (``dcp.save({"loader": loader, ...})``); :class:`SavePlanner`,
:class:`LoadPlanner`, :class:`SharedMetadataReader` and :func:`load` each fix, optionally, what
DCP's defaults cost or refuse once the job is large or its layout changed (docs/distributed.md
has the figures); :func:`read_loader_entries` reads a checkpoint's loader leaves in one process.
Nothing here changes what is saved. It leans on two of torch's private names
(``DefaultSavePlanner._create_global_plan``, and one ``read_metadata()`` per rank per load),
checked against torch 2.13.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import io
import json
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, StorageReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.checkpoint.planner import LoadPlanner as _TorchLoadPlanner
from torch.futures import Future

from .errors import StateMismatchError
from .loader.dropin.entries import ANY_RANK_KEY, RANK_KEY_PREFIX
from .loader.partitions import world_sizes_for
from .state.rank_state import (
    SLOT_KEY_PREFIX,
    is_partition_entries,
    rank_slots,
    slot_key,
)

__all__ = [
    "LoadPlanner",
    "SavePlanner",
    "SharedMetadataReader",
    "first_map_wins",
    "is_dcp_checkpoint",
    "load",
    "read_loader_entries",
]


# -- saving: the coordinator's global plan in linear time ----------------------------------------


def first_map_wins(maps: list[Mapping[str, Any]]) -> dict[str, Any]:
    """``dict(ChainMap(*maps))`` in one pass over the maps: the first map holding a key gives
    its value, and the keys come in ChainMap's order (the last map's first, then each earlier
    map's new ones). ChainMap looks each key up through the maps in turn, up to ``len(maps)``
    lookups per key; this updates a dict from the last map to the first, one step per entry."""
    merged: dict[str, Any] = {}
    for mapping in reversed(maps):
        merged.update(mapping)
    return merged


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (if it was on), back on after.

    Torch's global step allocates a few objects per item of every rank's plan (dataclasses);
    each full collection on the way traverses every live object, the N plans included, which
    made the step about twice as slow at 16,384 ranks (1.5-1.8 s against 0.5-0.7 s without,
    measured in one process). Cycles left unreachable during the block, if any, are freed by
    the next collection after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global plan takes time linear in the number of ranks.

    Same constructor, local plans, global plan and metadata as torch's (the tests and
    ``benchmarks/bench_ranks.py --coordinator`` compare them): only the merge of the ranks' key
    mappings, torch's ``dict(ChainMap(*mappings))``, is :func:`first_map_wins`. With
    ``enable_plan_caching=True`` every save after the first skips the global step (a loader's
    keys change only with its layout). Example::

        dcp.save({"model": model_state, "loader": loader}, checkpoint_id=step_dir,
                 planner=el.dcp.SavePlanner())
    """

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        mappings = [plan.planner_data for plan in all_plans]
        if not self.flatten_state_dict or not all(isinstance(m, Mapping) for m in mappings):
            return super()._create_global_plan(all_plans)
        # Torch's step over plans without mappings (its ChainMap then merges empty maps), then
        # each plan gets its own mapping back and the metadata the merged one.
        bare = [dataclasses.replace(plan, planner_data={}) for plan in all_plans]
        with _collection_paused():
            global_plan, metadata = super()._create_global_plan(bare)
        global_plan = [
            dataclasses.replace(plan, planner_data=mapping)
            for plan, mapping in zip(global_plan, mappings)
        ]
        return global_plan, dataclasses.replace(metadata, planner_data=first_map_wins(mappings))


# -- loading: a loader's template of the saved partition count ----------------------------------


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that fits each loader's template to the saved partition count.

    A fresh loader's ``state_dict()`` lists the slots its rank runs for its own
    ``num_partitions`` P'; a checkpoint of another count P lacks some or holds others, and
    torch's planner refuses a missing key before the loader is asked. Here every loader template
    (a dict of ``slot_`` keys, nested anywhere) is first rewritten to the slots its rank runs of
    the saved P (counted from the metadata; slot 0 alone where P does not divide among the world
    size), so the loader judges the saved leaves: one built without ``num_partitions`` adopts P,
    one built with P' != P raises :class:`~energy_loader.StateMismatchError` naming both counts,
    on every rank. A loader stored under per-rank keys (``rank_state_key``) loaded on another
    world size is refused naming both sizes and the recipe that resizes. Other keys are
    torch's. Example::

        loader = el.SavableDataLoader(build_pipeline(), num_workers=4)  # adopts the saved P
        dcp.load({"loader": loader}, checkpoint_id=step_dir, planner=el.dcp.LoadPlanner())
    """

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is not None:
            templates = dict(_loader_templates(state_dict, ""))
            if templates:
                saved = _saved_slot_counts(metadata, templates)
                for prefix, template in templates.items():
                    # Under a per-rank key (rank_state_key's) a prefix holds one rank's slots,
                    # not 0..P-1: left to torch (and refused below on another world size).
                    per_rank = _RANK_KEY.fullmatch(prefix.rpartition(".")[2]) is not None
                    if saved.get(prefix) and not per_rank:
                        _fit_template(template, prefix, saved[prefix], metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            _refuse_rank_keys_of_another_size(self.state_dict, metadata)


# A per-rank key (rank_state_key's): loader_rank_00003_of_00016.
_RANK_KEY = re.compile(r"(.+)_rank_(\d{5})_of_(\d{5})")


def _refuse_rank_keys_of_another_size(state_dict: Mapping[str, Any], metadata: Metadata) -> None:
    """Raise ``StateMismatchError`` when the load looks for per-rank keys
    (``loader_rank_00000_of_00003``) of a world size the checkpoint was not saved with: a
    loader stored under :func:`~energy_loader.rank_state_key` only loads on the saving world
    size, and torch would say no more than "Missing key in checkpoint state_dict"."""
    saved = metadata.state_dict_metadata
    for fqn in state_dict:
        if fqn in saved:
            continue
        head, _, _ = fqn.partition(".")
        match = _RANK_KEY.fullmatch(head)
        if match is None:
            continue
        prefix = match.group(1)
        sizes = [
            int(other.group(3))
            for key in saved
            if (other := _RANK_KEY.fullmatch(key.partition(".")[0])) is not None
            and other.group(1) == prefix
        ]
        if not sizes:
            continue
        size = min(sizes)
        raise StateMismatchError(
            f"the checkpoint stores {prefix!r} under per-rank keys of {size} rank(s) "
            f"({prefix}_rank_00000_of_{size:05d}, ...), this job of {int(match.group(3))} "
            f"rank(s) looks for {head!r}: per-rank keys tie a checkpoint to the world size "
            f"that saved it. Load it on {size} rank(s), and save the loader under one key "
            f"on every rank (dcp.save({{{prefix!r}: loader, ...}})), which loads on any world "
            "size (docs/distributed.md)"
        )


def _loader_templates(value: Any, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every dict of slot leaves under ``value``, with its key path as DCP flattens it
    (``"loader"``, ``"app.loader"``)."""
    if not isinstance(value, dict):
        return
    if prefix and is_partition_entries(value):
        yield prefix, value
        return
    for key, inner in value.items():
        yield from _loader_templates(inner, f"{prefix}.{key}" if prefix else str(key))


def _saved_slot_counts(metadata: Metadata, templates: Mapping[str, Any]) -> dict[str, int]:
    """How many slot keys the checkpoint holds under each template's prefix: the saved P."""
    counts = dict.fromkeys(templates, 0)
    for key in metadata.state_dict_metadata:
        prefix, _, leaf = key.rpartition(".")
        if leaf.startswith(SLOT_KEY_PREFIX) and prefix in counts:
            counts[prefix] += 1
    return counts


def _fit_template(template: dict[str, Any], prefix: str, saved: int, metadata: Metadata) -> None:
    """Rewrite ``template`` to the slots its rank runs of ``saved`` partitions (slot 0 alone
    when they do not divide among the world size), if the checkpoint holds them all."""
    header = _template_header(template)
    if header is None:
        return  # not a loader's fresh leaves: the loader will say what is wrong
    rank, world_size = header["rank"], header["world_size"]
    slots = rank_slots(rank, world_size, saved) if saved % world_size == 0 else range(1)
    wanted = [slot_key(slot) for slot in slots]
    if sorted(template) == wanted:
        return
    if any(f"{prefix}.{key}" not in metadata.state_dict_metadata for key in wanted):
        return  # slots missing from 0..P-1: torch names the missing key
    template.clear()
    template.update(dict.fromkeys(wanted, ""))  # DCP replaces each value with the saved leaf


def _template_header(template: dict[str, Any]) -> dict[str, Any] | None:
    """The ``rank_state`` of a template's first leaf if it names a rank of a world size, else
    None."""
    try:
        header: dict[str, Any] = json.loads(template[min(template)])["rank_state"]
        rank, world_size = header["rank"], header["world_size"]
    except (TypeError, ValueError, KeyError):
        return None
    if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
        return None
    return header


# -- loading with torch's planner: its missing-key failure in the loader's words ------------------


def load(state_dict: dict[str, Any], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, **kwargs)``, with a loader of another
    partition count than the checkpoint's refused in the loader's words.

    Same arguments, planner and result. Where the checkpoint holds fewer partitions than the
    loader lists, torch refuses during its own planning with a ``CheckpointException`` (a
    ``BaseException``) "Missing key in checkpoint state_dict: loader.slot_00001"; here that is a
    :class:`~energy_loader.StateMismatchError` naming both counts and the two fixes (the saved
    ``num_partitions``, or none and :class:`LoadPlanner`), chained to torch's, on every rank.
    Every other failure is torch's. Looks at loaders at the top level of ``state_dict`` and at
    loader templates at any depth; reads ``.metadata`` through ``storage_reader`` or from
    ``checkpoint_id``. Example::

        el.dcp.load({"model": model_state, "loader": loader}, checkpoint_id=step_dir)
    """
    try:
        dcp_load(state_dict, **kwargs)
    except CheckpointException as error:
        refusal = _fewer_partitions_saved(state_dict, kwargs)
        if refusal is None:
            raise
        raise refusal from error


def _fewer_partitions_saved(
    state_dict: dict[str, Any], kwargs: dict[str, Any]
) -> StateMismatchError | None:
    """The refusal of the first loader in ``state_dict`` that runs more partitions than the
    checkpoint holds slots under its key (None where there is none, or the checkpoint's
    metadata cannot be read: torch's failure then stands)."""
    if isinstance(kwargs.get("planner"), LoadPlanner):
        return None  # it listed the saved slots: what it could not fit, torch names
    templates = dict(_loader_templates(_loader_state_dicts(state_dict), ""))
    if not templates:
        return None
    try:
        metadata = _read_metadata_alone(kwargs)
    except Exception:  # what torch read a moment ago: unreadable now, torch's error stands
        return None
    if metadata is None:
        return None
    saved_counts = _saved_slot_counts(metadata, templates)
    for prefix, template in templates.items():
        header = _template_header(template)
        count = None if header is None else header.get("num_partitions")
        saved = saved_counts[prefix]
        if header is None or not isinstance(count, int) or not 0 < saved < count:
            continue
        world_size = header["world_size"]
        lacking = [
            key for key in sorted(template) if f"{prefix}.{key}" not in metadata.state_dict_metadata
        ]
        fix = (
            f"Build the loader with num_partitions={saved}, or leave num_partitions unset and "
            "load with planner=energy_loader.dcp.LoadPlanner(), which lists the saved "
            "count's slots (a loader built without num_partitions adopts the saved count)"
            if saved % world_size == 0
            else f"{saved} partition(s) run on a world size in {world_sizes_for(saved)}, not "
            f"on world_size={world_size}: load it on one of those, with num_partitions="
            f"{saved} or with planner=energy_loader.dcp.LoadPlanner()"
        )
        lacks = (
            f"this rank's {', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''}"
            if lacking
            else "another rank's slots"
        )
        slots = slot_key(0) if saved == 1 else f"{slot_key(0)} to {slot_key(saved - 1)}"
        return StateMismatchError(
            f"the checkpoint holds {prefix!r} of num_partitions={saved} ({slots}), and this "
            f"loader runs num_partitions={count} (on world_size={world_size} x num_workers="
            f"{header.get('num_workers')}): torch's load planner looks for the slots the "
            f"loader lists for its own count and refused {lacks}, which the checkpoint lacks, "
            f"before the loader was asked. {fix}"
        )
    return None


def _loader_state_dicts(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each savable loader at its top level replaced by its
    ``state_dict()``, the template DCP's load filled (DCP asks top-level values only); other
    values as they are, nothing else called."""
    from .loader.savable_loader import SavableDataLoader

    return {
        key: value.state_dict() if isinstance(value, SavableDataLoader) else value
        for key, value in state_dict.items()
    }


def _read_metadata_alone(kwargs: Mapping[str, Any]) -> Metadata | None:
    """The checkpoint's metadata, read by this rank alone, from a load's arguments."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = kwargs.get("storage_reader")
    if isinstance(reader, SharedMetadataReader):
        reader = reader.reader  # no broadcast in an error path
    if reader is None:
        checkpoint_id = kwargs.get("checkpoint_id")
        if checkpoint_id is None or not is_dcp_checkpoint(checkpoint_id):
            return None
        reader = FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    return metadata if isinstance(metadata, Metadata) else None


# -- reading: a checkpoint's loader leaves, without a process group ------------------------------


# The state_dict keys of a loader's leaves: a savable pipeline's slots, a drop-in loader's ranks
# (rank_00001, or rank_any).
_LOADER_LEAF = re.compile(rf"(?:{SLOT_KEY_PREFIX}|{RANK_KEY_PREFIX})\d{{5}}|{ANY_RANK_KEY}")


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by ``torch.distributed.checkpoint.save`` (it holds
    the ``.metadata`` file)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


class _PlainReadPlanner(DefaultLoadPlanner):
    """DCP's load planner for keys as given (not flattened again), whose non-tensor entries
    are read with ``torch.load(weights_only=True)``: a loader's leaves are JSON strings (or
    plain data), and nothing in a checkpoint is unpickled as objects (torch's own planner
    reads them with ``weights_only=False``)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def read_loader_entries(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The loader leaves of a DCP checkpoint folder, nested as they were saved:
    ``{"loader": {"slot_00000": "<JSON>", ...}}`` (``{"app": {"loader": ...}}`` for a loader
    saved under ``"app.loader"``), read in this process, without a process group.

    Reads the ``.metadata`` and, of the data, only the entries under a key that names a
    loader's slot (``slot_00003``) or a drop-in loader's rank (``rank_00001``, ``rank_any``),
    exactly: the model's tensors are not read. What ``inspect`` and ``replay`` read DCP with.
    ``FileNotFoundError`` if the folder has no ``.metadata``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if not is_dcp_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir}: not a torch.distributed.checkpoint folder (no .metadata file)"
        )
    reader = FileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata()
    mappings = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    template: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        path = tuple(mappings.get(fqn) or fqn.split("."))
        if not any(isinstance(part, str) and _LOADER_LEAF.fullmatch(part) for part in path):
            continue
        if isinstance(meta, BytesStorageMetadata):
            template[fqn] = None
        elif isinstance(meta, TensorStorageMetadata):
            template[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            continue
        paths[fqn] = path
    if template:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(template, storage_reader=reader, planner=_PlainReadPlanner(), no_dist=True)
    nested: dict[Any, Any] = {}
    for fqn, path in paths.items():
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = template[fqn]
    return nested


# -- loading: the .metadata read once, broadcast to the other ranks ------------------------------


@attrs.frozen
class _Unread:
    """What the coordinator broadcasts in place of the metadata when it could not read it."""

    error: str


class SharedMetadataReader(StorageReader):
    """A ``StorageReader`` whose ``read_metadata()`` reads storage on one rank only.

    Wraps any ``StorageReader``: on a DCP load the coordinator (rank ``coordinator_rank`` of
    ``process_group``, the default group when ``None``) reads the metadata and broadcasts it
    (``broadcast_object_list``); all else goes to the wrapped reader. Every rank still receives
    the whole metadata, but storage serves it once, not N times. The broadcast is a collective
    (``dcp.load`` calls ``read_metadata()`` once per rank): pass ``dcp.load``'s process group
    and coordinator. A coordinator's failure to read is broadcast (every rank raises); a rank
    that never arrives leaves the others waiting until the group's timeout. Without a process
    group, or with ``no_dist=True`` on a single-rank group, it reads locally; never use it with
    ``no_dist=True`` on some ranks of a larger group. With NCCL, set the CUDA device first.
    docs/distributed.md has the details. Example::

        reader = el.dcp.SharedMetadataReader(FileSystemReader(step_dir))
        dcp.load(state, storage_reader=reader, planner=el.dcp.LoadPlanner())
    """

    def __init__(
        self,
        reader: StorageReader,
        process_group: dist.ProcessGroup | None = None,
        coordinator_rank: int = 0,
    ) -> None:
        if not isinstance(reader, StorageReader):
            raise TypeError(
                "SharedMetadataReader wraps a torch.distributed.checkpoint StorageReader, e.g. "
                f"FileSystemReader(step_dir); got {type(reader).__name__}"
            )
        if isinstance(coordinator_rank, bool) or not isinstance(coordinator_rank, int):
            raise TypeError(f"coordinator_rank must be an int, got {coordinator_rank!r}")
        if coordinator_rank < 0:
            raise ValueError(
                f"coordinator_rank must be a rank of the process group (>= 0), got "
                f"{coordinator_rank}"
            )
        self.reader = reader
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self._forward_kwargs = (
            "kwargs" in inspect.signature(reader.set_up_storage_reader).parameters
        )

    @property
    def checkpoint_id(self) -> Any:
        """The wrapped reader's checkpoint id (DCP logs it)."""
        return getattr(self.reader, "checkpoint_id", None)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.reader.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata: read by the coordinator, received by the others.

        With arguments (torch asks ``read_metadata(rank=...)`` for a rank's own metadata when
        the global one is missing) it is the wrapped reader's call, on this rank alone.
        """
        if args or kwargs or not (dist.is_available() and dist.is_initialized()):
            return self.reader.read_metadata(*args, **kwargs)
        group_size = dist.get_world_size(self.process_group)
        if group_size == 1:
            return self.reader.read_metadata()
        if self.coordinator_rank >= group_size:
            raise ValueError(
                f"coordinator_rank {self.coordinator_rank} is not a rank of the process group "
                f"of {group_size} rank(s)"
            )
        coordinator = dist.get_rank(self.process_group) == self.coordinator_rank
        payload: list[Any] = [None]
        failure: Exception | None = None
        if coordinator:
            try:
                payload[0] = self.reader.read_metadata()
            except Exception as error:  # every rank must hear of it, or they would wait
                failure = error
                payload[0] = _Unread(f"{type(error).__name__}: {error}")
        dist.broadcast_object_list(
            payload, group=self.process_group, group_src=self.coordinator_rank
        )
        if failure is not None:
            raise failure
        if isinstance(payload[0], _Unread):
            raise RuntimeError(
                f"rank {self.coordinator_rank} (the coordinator) could not read the "
                f"checkpoint's metadata: {payload[0].error}"
            )
        if not isinstance(payload[0], Metadata):
            raise RuntimeError(
                f"the coordinator broadcast {type(payload[0]).__name__}, not the checkpoint's "
                "Metadata (do all ranks wrap their readers alike?)"
            )
        return payload[0]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._forward_kwargs:
            self.reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        else:
            self.reader.set_up_storage_reader(metadata, is_coordinator, *args)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.reader.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self.reader.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: _TorchLoadPlanner) -> Future[None]:
        return self.reader.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen by DCP on its own: pass it as ``storage_reader=``."""
        return False
