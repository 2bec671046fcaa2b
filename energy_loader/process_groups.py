"""torch.distributed process groups as a data loader sees them: is one initialised, and which
data-parallel rank and size this process has in a group.

Kept apart from :mod:`energy_loader.distributed` (the collectives over loader states) so that
:class:`~energy_loader.WorkerConfig` can be built from a process group without importing the
loader.
"""

from __future__ import annotations

from typing import Any


def process_group_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _require_initialized(what: str) -> None:
    if not process_group_initialized():
        raise ValueError(
            f"{what} needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (torchrun sets the variables it "
            "reads)"
        )


def _is_non_member(group: Any) -> bool:
    """Whether ``group`` is what ``new_group()`` returns on ranks outside the group."""
    import torch.distributed as dist

    return isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def _type_check_group(group: Any) -> None:
    """``TypeError`` unless ``group`` is a ProcessGroup, a DeviceMesh or the non-member marker."""
    import torch.distributed as dist

    is_mesh = callable(getattr(group, "get_group", None))
    if not (isinstance(group, dist.ProcessGroup) or is_mesh or _is_non_member(group)):
        raise TypeError(
            "`data_parallel_group` must be a torch.distributed ProcessGroup, a one-dimensional "
            f"DeviceMesh or None (got {type(group).__name__})"
        )


def _as_process_group(group: Any) -> Any:
    """``group`` as a ProcessGroup: a one-dimensional DeviceMesh becomes its group."""
    import torch.distributed as dist

    _type_check_group(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    if _is_non_member(group):
        raise ValueError(
            "`data_parallel_group` is torch.distributed's marker for 'not a member': "
            "new_group() returns it on ranks outside the group; pass the data-parallel group "
            "that contains this rank"
        )
    if group.ndim != 1:
        raise ValueError(
            f"`data_parallel_group` is a DeviceMesh with {group.ndim} dimensions; pass its "
            'data-parallel dimension, e.g. mesh["dp"]'
        )
    return group.get_group()


def data_parallel_layout(group: Any = None) -> tuple[Any, int, int]:
    """``(process group, rank in it, its size)`` of this process (``None``: the default group) for a
    ``ProcessGroup`` or 1-D ``DeviceMesh``; ``ValueError`` without one or if not a member."""
    import torch.distributed as dist

    _require_initialized("WorkerConfig.from_process_group")
    if group is None:
        return None, dist.get_rank(), dist.get_world_size()
    group = _as_process_group(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of "
            f"`data_parallel_group` (global ranks {dist.get_process_group_ranks(group)}); pass "
            "the data-parallel group that contains this rank"
        )
    return group, rank, dist.get_world_size(group)


def check_group_layout(group: Any, rank: int, world_size: int) -> None:
    """Raise unless ``rank``/``world_size`` are this process's rank in ``group`` and its size (for
    :class:`~energy_loader.WorkerConfig`)."""
    import torch.distributed as dist

    _type_check_group(group)
    _require_initialized("a WorkerConfig with a `data_parallel_group`")
    group = _as_process_group(group)
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    if (group_rank, group_size) != (rank, world_size):
        raise ValueError(
            f"WorkerConfig(rank={rank}, world_size={world_size}) disagrees with its "
            f"`data_parallel_group`, in which this process is rank {group_rank} of "
            f"{group_size}; build it with WorkerConfig.from_process_group(data_parallel_group="
            "...) to take both from the group"
        )
