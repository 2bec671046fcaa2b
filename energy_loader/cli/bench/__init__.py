"""``python -m energy_loader bench``: energy_loader, a plain torch DataLoader and the installed
peers running the same pipeline, side by side (see :mod:`energy_loader.cli.bench.runner`)."""

from .runner import main

__all__ = ["main"]
