"""The benchmark workloads (docs/benchmarks.md): energy_loader against a plain torch DataLoader.

``python -m energy_loader bench`` runs the reference workload alone; this runs any of the
workloads (``--workload reference|large|llm|vision``, :mod:`benchmarks.harness.workloads`)
through the same runner, with the CPU and peak RSS of every process and a figure
(:mod:`benchmarks.harness.runner`). ``benchmarks/bench_peers.py`` adds the other libraries'
loaders. Examples::

    python benchmarks/bench_loader.py --samples 60000 --repetitions 7 --out bench-results
    python benchmarks/bench_loader.py --workload large
    python benchmarks/bench_loader.py --workload llm      # 200,000 documents (--samples)
    python benchmarks/bench_loader.py --workload vision   # 20,000 JPEGs (--samples)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.harness

from benchmarks.harness.runner import WorkloadBench

if __name__ == "__main__":
    sys.exit(WorkloadBench().main(sys.argv[1:]))
