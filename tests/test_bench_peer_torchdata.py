"""The torchdata peer of the bench resumes its pipeline exactly (else its numbers mean little)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchdata.stateful_dataloader")

from benchmarks.harness.workloads import WORKLOADS
from benchmarks.peers.peer_torchdata import torchdata_contender, torchdata_real_contender
from energy_loader.cli.bench import BATCH


def _indices(loader) -> list[list[int]]:
    return [[int(i) for i in batch["index"]] for batch in loader]


@pytest.mark.parametrize(("workload", "samples"), [("reference", 2048), ("large", 256)])
def test_torchdata_peer_resumes_exactly_mid_epoch(workload: str, samples: int) -> None:
    contender = torchdata_contender()
    assert contender.missing() is None
    loader = contender.build(samples, workload)
    reference = _indices(loader)
    contender.close(loader)
    assert sorted(i for batch in reference for i in batch) == list(range(samples))
    # Stop inside the stream phase and inside the drain phase of the shuffle buffer.
    drain_start = (samples - 2 * WORKLOADS[workload].buffer) // BATCH
    for stop in sorted({len(reference) // 3, max(1, drain_start + 1), len(reference) - 2}):
        loader = contender.build(samples, workload)
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)
        state = contender.save(loader)
        contender.close(loader)
        restored = contender.restored(samples, workload, state)
        assert _indices(restored) == reference[stop:], f"stop after batch {stop}"
        contender.close(restored)
        assert contender.state_bytes(state) > 0


def test_torchdata_peer_resumes_the_llm_workload_exactly(tmp_path) -> None:
    """Its Stateful docs dataset (epoch, document, token offset) continues token for token."""
    from benchmarks.harness.data import ensure_data
    from benchmarks.harness.llm import fingerprint

    folder = ensure_data(tmp_path, "llm", 160, progress=False)
    contender = torchdata_real_contender("llm", folder)
    loader = contender.build(0, "llm")
    reference = [fingerprint(batch) for batch in loader]
    contender.close(loader)
    for stop in (1, len(reference) // 2, len(reference) - 1):
        loader = contender.build(0, "llm")
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)
        state = contender.save(loader)
        contender.close(loader)
        restored = contender.restored(0, "llm", state)
        assert [fingerprint(batch) for batch in restored] == reference[stop:], f"stop {stop}"
        contender.close(restored)
