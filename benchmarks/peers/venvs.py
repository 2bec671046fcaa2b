"""Where the peers whose requirements conflict with ours (MosaicML Streaming, Grain) find their
venvs: ``benchmarks/peer_venvs.sh`` makes one per peer, and the bench runs that peer's child
processes with the venv's python (each venv has this project installed too, so the child runs
``benchmarks/bench_peers.py`` as the parent does)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEFAULT_VENVS", "peer_venv_python", "venv_missing"]

# Where benchmarks/peer_venvs.sh makes the venvs when given no folder: the repository's.
DEFAULT_VENVS = Path(__file__).resolve().parents[2] / ".venv-peers"


def peer_venv_python(venvs: Path | None, name: str) -> str:
    """The python of the peer venv ``name`` under ``venvs`` (default :data:`DEFAULT_VENVS`)."""
    root = Path(venvs) if venvs is not None else DEFAULT_VENVS
    return str(root / name / "bin" / "python")


def venv_missing(python: str) -> Callable[[], str | None]:
    """A contender's ``missing`` check: why a peer in its own venv cannot run, or None."""

    def missing() -> str | None:
        if not os.path.exists(python):
            return f"no venv at {python} (make it: bash benchmarks/peer_venvs.sh)"
        return None

    return missing
