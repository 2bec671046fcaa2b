"""The committed corpus of version-1 states (``tests/state_corpus/v1/``) restores exactly.

Each state was saved by a loader of ``tests/state_corpus/setups.py`` after ``TAKEN`` batches,
and ``expected.json`` holds the batches that loader yielded next. A restore through each entry
point (a rank state, ``state_dict()`` leaves, per-rank files, a ``torch.distributed.checkpoint``
folder) must yield those batches, and so must an uninterrupted run of today's code: a state a
release wrote keeps restoring, and the stream it names keeps its meaning.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import energy_loader as el
from tests.state_corpus import setups

CORPUS = Path(__file__).parent / "state_corpus" / "v1"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())


def _read(name: str) -> Any:
    return json.loads((CORPUS / name).read_text())


def _rest_and_next_epoch(loader: el.SavableDataLoader, iterator: Any = None) -> list[list[int]]:
    """The batches from where ``loader`` stands to the end of its next epoch."""
    try:
        rest = [setups.keys(batch) for batch in (iterator if iterator is not None else loader)]
        return rest + [setups.keys(batch) for batch in loader]
    finally:
        loader.close()


def _assert_continues(
    restored: el.SavableDataLoader, make: Callable[[], el.SavableDataLoader], recorded: Any
) -> None:
    """``restored`` yields, to the end of the next epoch, what an uninterrupted run of today's
    code yields after ``TAKEN`` batches, and its first ``COMPARED`` batches are the ones the
    saving loader recorded."""
    continued = _rest_and_next_epoch(restored)
    assert continued[: setups.COMPARED] == recorded
    loader = make()
    iterator = iter(loader)
    setups.take(iterator, setups.TAKEN)
    assert continued == _rest_and_next_epoch(loader, iterator)


def _restored(make: Callable[[], el.SavableDataLoader], restore: Callable[[Any], None]) -> Any:
    loader = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a corpus state restores quietly: no code change seen
        restore(loader)
    return loader


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pipeline_rank_state_of_version_1_restores_exactly(workers: int) -> None:
    make = lambda: setups.pipeline(workers=workers)  # noqa: E731
    state = _read(f"pipeline_{workers}_workers.json")
    loader = _restored(make, lambda loader: loader.restore_state_rank(state))
    expected = EXPECTED[f"pipeline_{workers}_workers"]
    _assert_continues(loader, make, expected)


def _load_dcp(loader: el.SavableDataLoader) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"loader": loader}, checkpoint_id=CORPUS / "pipeline_2_ranks_dcp", no_dist=True)


@pytest.mark.parametrize("way", ["state_dict", "rank_files", "dcp"])
def test_a_two_rank_pipeline_save_of_version_1_restores_exactly(way: str) -> None:
    leaves = _read("pipeline_2_ranks_state_dict.json")
    restores = {
        "state_dict": lambda loader: loader.load_state_dict(leaves),
        "rank_files": lambda loader: el.restore_state_rank_file(
            loader, CORPUS / "pipeline_2_ranks_files"
        ),
        "dcp": _load_dcp,
    }
    for rank in range(2):
        make = lambda rank=rank: setups.pipeline(rank, 2)  # noqa: E731
        loader = _restored(make, restores[way])
        expected = EXPECTED["pipeline_2_ranks"][rank]
        _assert_continues(loader, make, expected)


@pytest.mark.parametrize("way", ["rank_state", "state_dict"])
def test_a_map_style_dropin_state_of_version_1_restores_exactly(way: str) -> None:
    state = _read("dropin_map.json" if way == "rank_state" else "dropin_map_state_dict.json")
    restore = {"rank_state": "restore_state_rank", "state_dict": "load_state_dict"}[way]
    loader = _restored(setups.dropin_map, lambda loader: getattr(loader, restore)(state))
    _assert_continues(loader, setups.dropin_map, EXPECTED["dropin_map"])


def test_dropin_rank_files_of_version_1_restore_exactly() -> None:
    folder = CORPUS / "dropin_2_ranks_files"
    for rank in range(2):
        make = lambda rank=rank: setups.dropin_map(rank, 2)  # noqa: E731
        loader = _restored(make, lambda loader: el.restore_state_rank_file(loader, folder))
        _assert_continues(loader, make, EXPECTED["dropin_2_ranks"][rank])


def test_an_iterable_dropin_state_of_version_1_restores_exactly() -> None:
    state = _read("dropin_iterable.json")
    loader = _restored(setups.dropin_iterable, lambda loader: loader.restore_state_rank(state))
    _assert_continues(loader, setups.dropin_iterable, EXPECTED["dropin_iterable"])


def _assert_steered(
    name: str, make: Callable[[], el.SavableDataLoader], run: Callable[[], Any]
) -> None:
    """The saved state of a run that skipped (and changed) on purpose restores into ``make``'s
    loader: the batches the saving loader yielded next, then what that run of today's code
    yields to the end of the next epoch; its history reads back as saved."""
    state = _read(f"{name}.json")
    loader = _restored(make, lambda loader: loader.restore_state_rank(state))
    assert loader.save_state_rank()["history"] == state["history"]
    continued = _rest_and_next_epoch(loader)
    assert continued[: setups.COMPARED] == EXPECTED[name]
    today, iterator = run()
    assert continued == _rest_and_next_epoch(today, iterator)


def test_a_steered_pipeline_state_of_version_1_restores_exactly() -> None:
    """Skips, a declared change of weights, and two partitions whose checkpoints predate it."""
    make = lambda: setups.blend_pipeline((3.0, 1.0))  # noqa: E731
    _assert_steered("pipeline_steered", make, setups.steered)


def test_a_dropin_state_with_a_skip_of_version_1_restores_exactly() -> None:
    _assert_steered("dropin_map_skipped", setups.dropin_map, setups.dropin_skipped)


def test_every_corpus_state_is_of_version_1() -> None:
    for path in CORPUS.glob("*.json"):
        if path.name == "expected.json":
            continue
        value = json.loads(path.read_text())
        texts = value.values() if "format" not in value else [value]
        for entry in texts:
            plain = json.loads(entry) if isinstance(entry, str) else entry
            plain = plain.get("rank_state", plain)
            assert plain["version"] == 1, path.name
