"""Write the committed corpus of saved states (``tests/state_corpus/v1/``).

Run from the repository root when a release adds a state format version (into a new folder):
``python -m tests.state_corpus.make_corpus`` (``--steered`` adds the states with a history to
an existing folder). Every state is saved after
``setups.TAKEN`` batches; ``expected.json`` records, for each, the ``setups.COMPARED`` batches'
indices the saving loader yielded next, which ``tests/test_state_corpus.py`` compares with what
a restore of the committed state yields now (and with an uninterrupted run of today's code).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

import energy_loader as el
from tests.state_corpus import setups

HERE = Path(__file__).parent / "v1"


def _write(name: str, value: Any) -> None:
    (HERE / name).write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")


def main() -> None:
    if HERE.exists():
        shutil.rmtree(HERE)
    HERE.mkdir(parents=True)
    expected: dict[str, Any] = {}

    # A pipeline on one rank without workers, and with two: save_state_rank().
    for workers in (0, 2):
        loader = setups.pipeline(workers=workers)
        iterator = iter(loader)
        setups.take(iterator, setups.TAKEN)
        _write(f"pipeline_{workers}_workers.json", loader.save_state_rank())
        expected[f"pipeline_{workers}_workers"] = setups.take(iterator, setups.COMPARED)
        loader.close()

    # A pipeline on two ranks: state_dict() leaves, per-rank files and a DCP folder.
    loaders = [setups.pipeline(rank, 2) for rank in range(2)]
    iterators = [iter(loader) for loader in loaders]
    for iterator in iterators:
        setups.take(iterator, setups.TAKEN)
    leaves = {key: leaf for loader in loaders for key, leaf in loader.state_dict().items()}
    _write("pipeline_2_ranks_state_dict.json", leaves)
    for loader in loaders:
        el.save_state_rank_file(loader, HERE / "pipeline_2_ranks_files")
    dcp.save({"loader": leaves}, checkpoint_id=HERE / "pipeline_2_ranks_dcp", no_dist=True)
    expected["pipeline_2_ranks"] = [setups.take(it, setups.COMPARED) for it in iterators]

    # Drop-ins: map-style on one rank, under a DistributedSampler on two, iterable.
    loader = setups.dropin_map()
    iterator = iter(loader)
    setups.take(iterator, setups.TAKEN)
    _write("dropin_map.json", loader.save_state_rank())
    _write("dropin_map_state_dict.json", loader.state_dict())
    expected["dropin_map"] = setups.take(iterator, setups.COMPARED)

    loaders = [setups.dropin_map(rank, 2) for rank in range(2)]
    iterators = [iter(loader) for loader in loaders]
    for iterator in iterators:
        setups.take(iterator, setups.TAKEN)
    for loader in loaders:
        el.save_state_rank_file(loader, HERE / "dropin_2_ranks_files")
    expected["dropin_2_ranks"] = [setups.take(it, setups.COMPARED) for it in iterators]

    loader = setups.dropin_iterable()
    iterator = iter(loader)
    setups.take(iterator, setups.TAKEN)
    _write("dropin_iterable.json", loader.save_state_rank())
    expected["dropin_iterable"] = setups.take(iterator, setups.COMPARED)

    steered(expected)
    _write("expected.json", expected)
    print(f"wrote {sum(1 for _ in HERE.rglob('*'))} entries under {HERE}", file=sys.stderr)


def steered(expected: dict[str, Any]) -> None:
    """States with a history of skips and changes, and a partition's pending change."""
    loader, iterator = setups.steered()
    _write("pipeline_steered.json", loader.save_state_rank())
    expected["pipeline_steered"] = setups.take(iterator, setups.COMPARED)
    loader.close()
    loader, iterator = setups.dropin_skipped()
    _write("dropin_map_skipped.json", loader.save_state_rank())
    expected["dropin_map_skipped"] = setups.take(iterator, setups.COMPARED)


if __name__ == "__main__":
    if sys.argv[1:] == ["--steered"]:  # added to v1 beside the states written before it
        recorded = json.loads((HERE / "expected.json").read_text())
        steered(recorded)
        _write("expected.json", recorded)
    else:
        main()
