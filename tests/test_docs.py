"""The docs cannot rot: the site builds strictly and every public name is documented."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import energy_loader

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_has_an_entry_in_the_api_reference() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### (\w+)$", text, flags=re.MULTILINE))
    missing = sorted(set(energy_loader.__all__) - documented)
    assert not missing, f"add these to docs/api.md: {missing}"


def test_public_names_are_sorted_and_importable() -> None:
    assert list(energy_loader.__all__) == sorted(energy_loader.__all__)
    for name in energy_loader.__all__:
        assert getattr(energy_loader, name) is not None


@pytest.mark.timeout(120)
def test_the_docs_site_builds_strictly(tmp_path) -> None:
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.fail("mkdocs is part of the dev extra; install with pip install -e '.[dev]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "index.html").exists()
