"""Property: for random datasets, torch arguments and stop points, the drop-in loader yields
what torch's DataLoader yields, and a restore continues exactly like the uninterrupted run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, SubsetRandomSampler, WeightedRandomSampler

import energy_loader as el

from .dropin_helpers import (
    Augmenting,
    Dicts,
    Sharded,
    StatefulSharded,
    assert_same,
    run_epochs,
    stop_and_resume,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@st.composite
def _setups(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["map", "augmenting", "iterable", "stateful_iterable"]))
    length = draw(st.integers(1, 14))
    workers = draw(st.integers(0, 3))
    arguments: dict[str, Any] = {
        "num_workers": workers,
        "persistent_workers": workers > 0 and draw(st.booleans()),
    }
    batch_size = draw(st.sampled_from([None, 1, 2, 3, 5]))
    arguments["batch_size"] = batch_size
    if batch_size is not None:
        arguments["drop_last"] = draw(st.booleans())
    if kind in ("map", "augmenting"):
        kinds = ["sequential", "shuffle", "generator", "weighted", "subset"]
        arguments["sampler_kind"] = draw(st.sampled_from(kinds))
    return {
        "kind": kind,
        "length": length,
        "arguments": arguments,
        "stop_fraction": draw(st.floats(0, 1)),
        "resume_workers": workers if kind.endswith("iterable") else draw(st.integers(0, 2)),
    }


def _make(setup: dict[str, Any], cls: Any, workers: int | None = None) -> Any:
    arguments = dict(setup["arguments"])
    if workers is not None:
        arguments["num_workers"] = workers
        arguments["persistent_workers"] = arguments["persistent_workers"] and workers > 0
    kind, length = setup["kind"], setup["length"]
    sampler = arguments.pop("sampler_kind", None)
    if sampler == "shuffle":
        arguments["shuffle"] = True
    elif sampler == "generator":
        arguments["shuffle"] = True
        arguments["generator"] = torch.Generator().manual_seed(length)
    elif sampler == "weighted":
        arguments["sampler"] = WeightedRandomSampler([1.0 + i % 3 for i in range(length)], length)
    elif sampler == "subset":
        arguments["sampler"] = SubsetRandomSampler(range(0, length, 2))
    dataset = {
        "map": Dicts,
        "augmenting": Augmenting,
        "iterable": Sharded,
        "stateful_iterable": StatefulSharded,
    }[kind](length)
    return cls(dataset, **arguments)


@given(_setups())
def test_equal_to_torch_and_resume_equals_the_uninterrupted_run(setup: dict[str, Any]) -> None:
    if setup["kind"] != "augmenting":  # deterministic __getitem__: torch's batches exactly
        torch.manual_seed(1)
        theirs = run_epochs(_make(setup, DataLoader), 2)
        torch.manual_seed(1)
        ours_loader = _make(setup, el.SavableDataLoader)
        ours = run_epochs(ours_loader, 2)
        ours_loader.close()
        assert_same(ours, theirs)
        total = len(ours)
    else:
        total = len(_make(setup, DataLoader)) * 2
    # Persistence must match between runs (torch draws base seeds differently): keep it.
    stop = round(setup["stop_fraction"] * total)
    workers = setup["arguments"]["num_workers"]
    resume_workers = setup["resume_workers"]
    if setup["arguments"]["persistent_workers"] and resume_workers == 0:
        resume_workers = workers
    make = lambda w: _make(setup, el.SavableDataLoader, w)  # noqa: E731
    stop_and_resume(make, workers, resume_workers, stop, 2)
