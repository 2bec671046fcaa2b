"""The drop-in loader's ``state_dict()`` layout: one JSON leaf per rank, under the rank's key.

Why not the plain state. ``torch.distributed.checkpoint`` flattens a nested dict into one
entry per leaf and, when several ranks save an entry under the same key, keeps one rank's
(it assumes replicas), so the ranks' plain states would be mixed field by field; and it loads
into the shape of the fresh loader's state, which a saved sampler state or iterable pipeline
state does not have. ``{"rank_00001": "<JSON>"}`` keeps the ranks apart and loads whatever
the state holds, as the savable pipeline's one leaf per partition does
(:func:`energy_loader.state.rank_state.partition_entries`). The same layout holds every
rank's state when a trainer keeps one checkpoint for the whole job (Lightning's callback
gathers them into it); each rank then takes its own entry.

Not here: the state's content (:mod:`energy_loader.loader.dropin.state`), which this module
treats as opaque plain data with a ``rank``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import StateFormatError
from ...state.plain import StateReader, is_keyed_by, json_leaf

RANK_KEY_PREFIX = "rank_"
# The key of a state any rank restores from (the job's position under a DistributedSampler):
# the same on every rank and every world size, so DCP loads it onto any number of ranks.
ANY_RANK_KEY = "rank_any"

_encode = json.JSONEncoder(separators=(",", ":")).encode


def rank_key(rank: int) -> str:
    """The state_dict key of one rank's state: ``rank_00001``."""
    return f"{RANK_KEY_PREFIX}{rank:05d}"


def rank_entries(states: Sequence[Any]) -> dict[str, Any]:
    """Each plain state under its rank's key, as compact JSON; one JSON cannot hold (tensors) stays
    a dict leaf, which DCP stores field by field."""
    out: dict[str, Any] = {}
    for index, state in enumerate(states):
        key = rank_key(StateReader(state, f"states[{index}]").int("rank"))
        try:
            out[key] = _encode(state)
        except (TypeError, ValueError):
            out[key] = state
    return out


def is_rank_entries(value: Any) -> bool:
    """Whether ``value`` is :func:`rank_entries`' layout (not a plain state)."""
    return is_keyed_by(value, RANK_KEY_PREFIX)


def states_of_entries(entries: dict[str, Any]) -> list[Any]:
    """The plain states of :func:`rank_entries`, in rank order; ``StateFormatError`` for a bad leaf
    or a key that does not name its rank."""
    states = []
    for key, leaf in sorted(entries.items()):
        if isinstance(leaf, str):
            leaf = json_leaf(leaf, f"state_dict[{key!r}]")
        rank = StateReader(leaf, f"state_dict[{key!r}]").int("rank")
        if key != ANY_RANK_KEY and rank_key(rank) != key:
            raise StateFormatError(
                f"state_dict[{key!r}] holds the state of rank {rank}; each rank's state goes "
                f"under its own key ({rank_key(rank)!r}), as state_dict() writes it"
            )
        states.append(leaf)
    return states
