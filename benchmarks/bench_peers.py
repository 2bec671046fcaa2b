"""The bench's workloads with the other libraries' loaders side by side with ours and a plain
torch DataLoader, in one run: where the peers' figures of docs/benchmarks.md come from.

It is ``benchmarks/bench_loader.py`` (same workloads, options, tables, bench.json and figure)
with the peers of ``benchmarks/peers/`` added to its contenders: torchdata's
``StatefulDataLoader`` and megatron-energon's ``SavableDataLoader`` when installed (``pip
install -c constraints.txt -e '.[bench]'``), MosaicML Streaming and Grain on the llm and
vision workloads when their venvs exist (``bash benchmarks/peer_venvs.sh``; ``--peer-venvs``
if not in the repository's ``.venv-peers``). A peer that cannot run is listed, with why.
Examples::

    python benchmarks/bench_peers.py                        # the reference workload
    python benchmarks/bench_peers.py --workload large
    python benchmarks/bench_peers.py --workload llm --batches 2000
    python benchmarks/bench_peers.py --workload vision
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.harness, .peers

from benchmarks.harness.bench import Contender
from benchmarks.harness.runner import WorkloadBench
from benchmarks.peers import peer_contenders


class PeerBench(WorkloadBench):
    """The workloads' bench with the peers after ours and the plain DataLoader."""

    prog = "python benchmarks/bench_peers.py"
    description = (
        "The benchmark workloads (docs/benchmarks.md): a plain torch DataLoader, energy_loader "
        "and the installed peers (torchdata, megatron-energon: pip install -c constraints.txt "
        "-e '.[bench]'; MosaicML Streaming and Grain in their own venvs: bash "
        "benchmarks/peer_venvs.sh) running the same pipeline, interleaved repetitions, medians "
        "and ratios."
    )
    # Each measured run, a peer's in its own venv too, is this file run again.
    command = (str(Path(__file__).resolve()),)

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        super().add_options(parser)
        parser.add_argument(
            "--peer-venvs",
            type=Path,
            default=None,
            help="where benchmarks/peer_venvs.sh made the venvs of MosaicML Streaming and Grain "
            "(default: .venv-peers in the repository)",
        )

    def contenders(self, args: argparse.Namespace) -> list[Contender]:
        peers = peer_contenders(args.workload, self.folder(args), args.peer_venvs)
        return [*super().contenders(args), *peers]


if __name__ == "__main__":
    sys.exit(PeerBench().main(sys.argv[1:]))
