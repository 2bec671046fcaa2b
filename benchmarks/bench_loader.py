"""The reference benchmark (docs/benchmarks.md): energy_loader vs a plain torch DataLoader.

Same as ``python -m energy_loader bench``; kept here so the benchmarks folder is the one place
to look. Example::

    python benchmarks/bench_loader.py --samples 60000 --repetitions 7 --out bench-results
"""

from __future__ import annotations

import sys

from energy_loader.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
