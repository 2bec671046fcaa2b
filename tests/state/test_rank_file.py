"""Per-rank state files: what a resized rank reads of them, and how damage is caught.

Ranks are simulated in one process (explicit ``WorkerConfig`` s); the real multi-process
bound on bytes read is in tests/test_distributed.py.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

import energy_loader as el
from energy_loader import distributed as eld
from energy_loader.cli.inspect import read_path
from energy_loader.state.rank_file import RankFile, ReadTally, read_rank_file, write_rank_file

PARTITIONS = 12
SEED = 5


def _pipeline(length: int = 240) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(length, lambda i: {"i": i}, shuffle=True, seed=3)
    return el.BatchDataset(el.ShuffleBufferDataset(source, 4), 2)


def _loader(rank: int, world_size: int, length: int = 240) -> el.SavableDataLoader:
    config = el.WorkerConfig(rank=rank, world_size=world_size, num_workers=0, seed=SEED)
    return el.SavableDataLoader(_pipeline(length), worker_config=config, num_partitions=PARTITIONS)


def _ids(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["i"]]


def _job(world_size: int, steps: int) -> list[list[int]]:
    """``steps`` steps of every rank, interleaved: the job's stream."""
    iterators = [iter(_loader(r, world_size)) for r in range(world_size)]
    return [_ids(next(it)) for _ in range(steps) for it in iterators]


def _saved_job(folder: Path, world_size: int, steps: int) -> None:
    loaders = [_loader(r, world_size) for r in range(world_size)]
    iterators = [iter(loader) for loader in loaders]
    for _ in range(steps):
        for iterator in iterators:
            next(iterator)
    for loader in loaders:
        eld.save_state_rank_file(loader, folder)


def test_a_rank_file_holds_the_state_save_state_rank_returned(tmp_path: Path) -> None:
    loader = _loader(1, 4)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.save_state_rank()
    path = write_rank_file(tmp_path / "rank.pt", state)
    assert read_rank_file(path) == json.loads(json.dumps(state))
    with zipfile.ZipFile(path) as archive:  # a plain ZIP of JSON: `unzip -p FILE rank.json`
        assert archive.namelist() == ["rank.json", "partitions", "config.json"]
        header = json.loads(archive.read("rank.json"))
    assert sorted(header["slots"]) == [1, 5, 9]  # rank 1 of 4 holds slots 1, 5, 9 of 12
    assert "config" not in header["state"] and "partitions" not in header["state"]
    ((_, shown),) = read_path(path)  # what `python -m energy_loader inspect FILE` prints
    assert shown == read_rank_file(path)
    whole = {"format": "some other state", "rank": 0}  # e.g. a drop-in loader's: kept whole
    assert read_rank_file(write_rank_file(tmp_path / "whole.pt", whole)) == whole


@pytest.mark.parametrize(("saved", "restored"), [(4, 3), (4, 6), (3, 2), (2, 4)])
def test_a_resized_rank_reads_only_the_slots_it_runs(
    tmp_path: Path, saved: int, restored: int
) -> None:
    steps = 5
    expected = _job(1, 60)
    _saved_job(tmp_path, saved, steps)
    with_witness = ReadTally()
    eld.read_rank_state_files(_loader(0, saved), tmp_path, tally=with_witness)
    # Its own file, and the header of one other rank's (the witness of one save).
    assert with_witness.files == 2
    same_layout = ReadTally()
    with RankFile(eld.rank_state_path(tmp_path, _loader(0, saved)), same_layout) as own:
        own.state()
    assert with_witness.bytes - same_layout.bytes <= 1024, (with_witness, same_layout)
    loaders = [_loader(r, restored) for r in range(restored)]
    for rank, loader in enumerate(loaders):
        tally = ReadTally()
        states = eld.read_rank_state_files(loader, tmp_path, tally=tally)
        runs = PARTITIONS // restored
        assert sum(len(s.partitions) for s in states) == runs  # its partitions, no others
        holders = {s % saved for s in range(rank, PARTITIONS, restored)}
        # The files holding its slots, and, where that is one file, one other's header (the
        # witness of one save).
        assert tally.files == len(holders) + (len(holders) == 1)
        # Its partitions' share of what same-layout ranks read, plus a header per file.
        share = same_layout.bytes * runs / (PARTITIONS // saved)
        assert tally.bytes <= 2 * max(share, same_layout.bytes), (rank, tally, same_layout)
        loader.restore_from_states(states)
    iterators = [iter(loader) for loader in loaders]
    tail = [_ids(next(it)) for _ in range(6) for it in iterators]
    position = steps * saved
    assert tail == expected[position : position + len(tail)]


def test_damage_to_any_byte_a_restore_reads_is_caught(tmp_path: Path) -> None:
    _saved_job(tmp_path, 2, 3)
    files = eld.rank_state_files(tmp_path)
    originals = [f.read_bytes() for f in files]
    with RankFile(files[1]) as file:
        offset, length = file.slots["slot_00003"]  # rank 0 of 3 runs slot 3: rank 1's
        in_partition = file._partitions_at + offset + length // 2
    config = originals[0].index(b"config.json") + len("config.json") + 3  # read from rank 0's
    header = originals[1].index(b"rank.json") + len("rank.json") + 5
    for rank, position in ((1, in_partition), (0, config), (1, header)):
        damaged = bytearray(originals[rank])
        damaged[position] ^= 0x20
        files[rank].write_bytes(bytes(damaged))
        with pytest.raises(el.StateFormatError, match=r"damaged|digest") as caught:
            eld.restore_state_rank_file(_loader(0, 3), tmp_path)  # a resize: ranged reads
        assert files[rank].name in str(caught.value), position
        with pytest.raises(el.StateFormatError, match=r"damaged|digest"):
            eld.restore_state_rank_file(_loader(rank, 2), tmp_path)  # the same layout: whole
        files[rank].write_bytes(originals[rank])
    files[1].write_bytes(originals[1][: len(originals[1]) // 2])
    with pytest.raises(el.StateFormatError, match="truncated"):
        eld.restore_state_rank_file(_loader(0, 3), tmp_path)


def test_files_of_two_saves_mixed_are_refused(tmp_path: Path) -> None:
    _saved_job(tmp_path / "a", 2, 3)
    for rank in range(2):  # the same job layout, another pipeline (a longer source)
        loader = _loader(rank, 2, length=480)
        iterator = iter(loader)
        next(iterator)
        eld.save_state_rank_file(loader, tmp_path / "b")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for folder, rank in (("a", 0), ("b", 1)):
        name = f"loader_rank_{rank:05d}_of_00002.pt"
        (mixed / name).write_bytes((tmp_path / folder / name).read_bytes())
    with pytest.raises(el.StateMismatchError, match="different pipeline configs"):
        eld.restore_state_rank_file(_loader(0, 1), mixed)
