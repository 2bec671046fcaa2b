"""The energon peer of the bench resumes its pipeline exactly (else its numbers mean little)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.energon")

from energy_loader.cli.bench.peer_energon import energon_contender

# energon always asks torch to pin memory; without an accelerator torch says so and skips it.
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

SAMPLES = 2048


def _indices(loader: Any) -> list[list[int]]:
    return [[int(i) for i in batch["index"]] for batch in loader]


def test_energon_peer_is_available() -> None:
    assert energon_contender().missing() is None


def test_energon_peer_resumes_exactly_mid_epoch(no_leftover_processes: None) -> None:
    contender = energon_contender()
    loader = contender.build(SAMPLES, "reference")
    reference = _indices(loader)
    contender.close(loader)
    assert sorted(i for batch in reference for i in batch) == list(range(SAMPLES))

    stop = len(reference) // 2
    loader = contender.build(SAMPLES, "reference")
    iterator = iter(loader)
    taken = [[int(i) for i in next(iterator)["index"]] for _ in range(stop)]
    state = contender.save(loader)
    contender.close(loader)
    assert taken == reference[:stop]

    restored = contender.restored(SAMPLES, "reference", state)
    assert _indices(restored) == reference[stop:], f"stop after batch {stop}"
    contender.close(restored)
    assert contender.state_bytes(state) > 0


def test_energon_peer_rejects_unknown_options() -> None:
    with pytest.raises(TypeError, match="no options"):
        energon_contender().build(SAMPLES, "reference", snapshot_every=50)
