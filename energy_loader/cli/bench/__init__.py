"""``python -m energy_loader bench``: energy_loader and a plain torch DataLoader running the same
pipeline, side by side (see :mod:`energy_loader.cli.bench.runner`). Other libraries' loaders are
compared by the repository's ``benchmarks/bench_peers.py``, through the same runner; their
adapters are not part of the installed package."""

from .runner import main

__all__ = ["main"]
