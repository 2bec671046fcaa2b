"""The worker's position book as a pure rule: snapshots filed, items recorded, a position read
off it (no loader, no processes)."""

from __future__ import annotations

from energy_loader.state.digests import key_digest
from energy_loader.state.positions import PositionBook, Snapshot
from energy_loader.state.rank_state import PartitionState


def _snapshot(counter: int, following: int = 0) -> Snapshot:
    """Both partitions' checkpoints after ``counter`` items each."""
    return Snapshot(
        (PartitionState(0, {"n": counter}), PartitionState(1, {"n": counter})), following
    )


def _book() -> PositionBook:
    """Two partitions taking turns: items 0 and 1, a snapshot after item 1, then 2, 3, 4."""
    book = PositionBook(capacity=8, in_flight=4)
    book.start(_snapshot(0))
    book.record(0, 0, ("a",), "made-a")
    book.record(1, 1, ("b",), "made-b")
    book.add(1, _snapshot(1))
    for index, key in ((2, "c"), (3, "d"), (4, "e")):
        book.record(index, index % 2, (key,), f"made-{key}")
    return book


def test_a_position_is_the_newest_snapshot_plus_the_items_made_since() -> None:
    states, following = _book().position_at(4)
    assert [(s.partition, s.checkpoint, s.skip) for s in states] == [
        (0, {"n": 1}, 2),  # items 2 and 4 to replay
        (1, {"n": 1}, 1),  # item 3
    ]
    assert [s.last for s in states] == [key_digest(("e",)), key_digest(("d",))]
    assert [s.made for s in states] == ["made-e", "made-d"]
    assert following == 1  # item 4 was partition 0's: partition 1's turn


def test_a_snapshot_right_after_the_last_items_is_placed_one_earlier_to_re_make_them() -> None:
    # At item 1 the newest snapshot follows both partitions' last items: nothing to replay
    # would leave nothing to check, so each goes back to the snapshot before its last item.
    states, following = _book().position_at(1)
    assert [(s.checkpoint, s.skip) for s in states] == [({"n": 0}, 1), ({"n": 0}, 1)]
    assert [s.last for s in states] == [key_digest(("a",)), key_digest(("b",))]
    assert following == 0


def test_an_ended_epoch_restarts_every_partition_in_the_current_one() -> None:
    book = _book()
    ended = Snapshot(
        (PartitionState(0, {"n": 3}, done=True), PartitionState(1, {"n": 2}, done=True)), 1
    )
    book.receive(5, -1, ((5, ended),))  # the worker's end marker, with its last snapshot
    states, _ = book.position_at(5)  # in the epoch that ended: both partitions done
    assert [s.done for s in states] == [True, True]
    states, following = book.position_at(5, epoch_ended=False)  # the rank went on
    assert [(s.checkpoint, s.done, s.skip) for s in states] == [
        ({"n": 3}, False, 0),
        ({"n": 2}, False, 0),
    ]
    assert following == 0  # a new epoch's round-robin starts over
