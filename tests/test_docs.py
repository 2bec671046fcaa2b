"""The docs cannot rot: every code block runs, the site builds strictly, every public name and
argument is documented, and the README's commands are the ones CI runs.

The code blocks of README.md and docs/ (docs/design.md included), by their fence:

- ``python``: run. A page is one script: its python blocks run in order in one namespace
  (``__name__ == "__main__"``), in a temporary folder, in this process (worker processes fork
  from it); then every ``test_*``
  function the page defined is called, as pytest would (a page can show the test a reader
  puts in their own suite). Keep them cheap: small data, ``num_workers`` <= 2.
- ``json``: must parse (``"..."`` stands for what is left out).
- ``bash``/``sh``/``console``: commands, not run here: marked as fragments (below), or
  ``<!-- checked: test_name -->`` when a test of this file checks them.
- ``text`` or no language: output and diagrams, not code.

Markers, an HTML comment on the line right before a block's opening fence (invisible on the
site and on GitHub):

- ``<!-- fragment: why -->``: not run; say why (it needs your model, a cluster, a dataset you
  have). Prefer a runnable block: a fragment can drift.
- ``<!-- checked: test_name -->``: a command that the named test of this file checks.

And anywhere on a page, ``<!-- doc-test: slow -->``: the page runs only with the slow tests
(``--run-slow``), as a script in a process of its own (``python page.py``): a page that starts
a framework's trainer or a process group, tens of seconds.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

import energy_loader

from .doc_api import API_PATH, generated_reference, replace_generated

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(fragment|checked)\b:?\s*(.*?)\s*-->\s*$")
_SLOW_PAGE = "<!-- doc-test: slow -->"
_COMMANDS = {"bash", "sh", "shell", "console"}
_OUTPUT = {"", "text"}


@attrs.frozen
class Block:
    """One fenced block of a page: its language, its first line number, its code, and the
    marker on the line before it (``fragment``/``checked``, or ``None``) with its reason."""

    page: Path
    language: str
    line: int
    code: str
    marker: str | None
    reason: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> Iterator[Block]:
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        before = _MARKER.match(lines[index - 1].strip()) if index else None
        yield Block(
            page,
            opening.group(1).lower(),
            index + 1,
            textwrap.dedent("\n".join(lines[index + 1 : end])),
            before.group(1) if before else None,
            before.group(2) if before else "",
        )
        index = end + 1


def _is_slow(page: Path) -> bool:
    return _SLOW_PAGE in page.read_text()


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks_of(page) if b.language == "python" and b.marker is None]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


_RUNNABLE = [p for p in PAGES if _runnable(p)]
_FAST_PAGES = [p for p in _RUNNABLE if not _is_slow(p)]
_SLOW_PAGES = [p for p in _RUNNABLE if _is_slow(p)]


def run_page_in_a_process(page: Path, folder: Path) -> None:
    """Run the page's python blocks as one script file in ``folder``, in a fresh interpreter
    that imports this checkout's energy_loader."""
    script = folder / f"{page.stem}.py"
    script.write_text("\n\n".join(block.code for block in _runnable(page)) + "\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, script.name], cwd=folder, capture_output=True, text=True, timeout=280,
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"{_page_id(page)}:\n{result.stderr[-4000:]}"


def run_page(page: Path, folder: Path) -> None:
    """Run the page's python blocks as one script in ``folder``, then its ``test_*``
    functions; a failure names the page and the block's line."""
    namespace: dict[str, object] = {"__name__": "__main__"}  # a script, as a reader runs it
    try:
        for block in _runnable(page):
            exec(compile(block.code, block.where(), "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value):
                value()
    finally:
        namespace.clear()  # the page's loaders go, and their workers with them
        gc.collect()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", _FAST_PAGES, ids=_page_id)
def test_the_code_of_a_page_runs(page: Path, tmp_path, monkeypatch, no_leftover_processes) -> None:
    monkeypatch.chdir(tmp_path)
    run_page(page, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", _SLOW_PAGES, ids=_page_id)
def test_the_code_of_a_slow_page_runs(page: Path, tmp_path) -> None:
    run_page_in_a_process(page, tmp_path)


def test_every_code_block_runs_or_is_marked() -> None:
    unmarked, unknown, empty_reason = [], [], []
    for page in PAGES:
        for block in blocks_of(page):
            if block.marker == "fragment" and not block.reason:
                empty_reason.append(block.where())
            if block.language in _COMMANDS and block.marker is None:
                unmarked.append(block.where())
            elif block.language not in {"python", "json", *_COMMANDS, *_OUTPUT}:
                unknown.append(f"{block.where()} ({block.language})")
    assert not unmarked, (
        "commands that are neither checked nor marked (see the top of tests/test_docs.py): "
        f"{unmarked}"
    )
    assert not unknown, f"code blocks of a language this test does not know: {unknown}"
    assert not empty_reason, f"fragments must say why they are not run: {empty_reason}"


def test_checked_markers_name_tests_of_this_file() -> None:
    names = set(globals())
    for page in PAGES:
        for block in blocks_of(page):
            if block.marker == "checked":
                assert block.reason in names, f"{block.where()}: no test named {block.reason!r}"


def test_json_blocks_parse() -> None:
    for page in PAGES:
        for block in blocks_of(page):
            if block.language == "json":
                json.loads(block.code)


def test_the_readme_commands_are_the_ones_ci_runs() -> None:
    commands = [b.code for b in blocks_of(ROOT / "README.md") if b.language == "bash"]
    demo, tests = commands
    setup = "python3 -m venv .venv && . .venv/bin/activate && "
    assert demo == setup + (
        "pip install -c constraints.txt -e '.[demo]' && python -m energy_loader demo"
    )
    assert tests.startswith(setup)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[len(setup) :] in ci, "the README's test command must be a line of .ci/run"


def test_the_readme_is_short_before_its_first_link_list() -> None:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## Documentation", 1)[0]
    words = len(head.split())
    assert words < 500, f"the README has {words} words before its link list (under 500)"


def test_every_public_name_has_an_entry_in_the_api_reference() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### (\w+)$", text, flags=re.MULTILINE))
    missing = sorted(set(energy_loader.__all__) - documented)
    assert not missing, f"add these to docs/api.md: {missing}"


def test_the_api_reference_lists_every_argument_with_its_default() -> None:
    text = API_PATH.read_text()
    assert replace_generated(text, generated_reference()) == text, (
        "docs/api.md's argument reference is out of date: run python -m tests.doc_api"
    )


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


def test_the_ratio_figures_are_drawn_from_the_recorded_tables(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_doc_ratios as figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    dropin = figures.ratios(figures.section(text, "The drop-in loader on a plain Dataset"))
    assert figures.Ratio("SavableDataLoader", 2.86, 2.48, 3.11) in dropin
    formats = figures.section(
        text, "Reading the peers' formats: MDS, litdata chunks, Megatron indexed files"
    )
    assert figures.Ratio("MDS: samples/s", 5.47, 4.67, 6.69) in figures.ratios(formats)
    assert figures.main(["--out", str(tmp_path)]) == 0
    for name, _ in figures.FIGURES.values():
        assert (tmp_path / name).stat().st_size > 10_000
        assert f"]({name})" in text  # the page shows it
