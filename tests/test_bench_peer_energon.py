"""The energon peer of the bench resumes its pipeline exactly (else its numbers mean little)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.energon")

from benchmarks.peers.peer_energon import energon_contender

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


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_energon_reads_the_vision_tars_and_resumes_pixel_for_pixel(tmp_path) -> None:
    """energon's own webdataset reader over the bench's tars (``.nv-meta`` written by the
    contender's ``prepare``); with ``restore_seeds`` the augmentations come back too."""
    from benchmarks.harness.data import ensure_data
    from benchmarks.harness.vision import fingerprint
    from benchmarks.peers.peer_energon import energon_vision_contender

    folder = ensure_data(tmp_path, "vision", 256, progress=False)
    contender = energon_vision_contender(folder)
    contender.prepare()
    assert (folder / "tars" / ".nv-meta" / "dataset.yaml").exists()
    loader = contender.build(256, "vision")
    reference, states = [], []
    for batch in loader:
        reference.append(fingerprint(batch))
        states.append(contender.save(loader))
    contender.close(loader)
    assert len(reference) == 4 and batch["image"].shape[1:] == (3, 224, 224)
    for stop in (1, 2):
        restored = contender.restored(256, "vision", states[stop - 1])
        tail = []
        for batch in restored:
            tail.append(fingerprint(batch))
            if len(tail) == len(reference) - stop:
                break
        contender.close(restored)
        assert tail == reference[stop:], f"restored after batch {stop}"
