"""The ratio figures of docs/benchmarks.md, drawn from the numbers recorded in its tables.

Each figure is one section of the page: the first table there with a ratio column (a header
with ``x torch``, ``x default`` or ``median`` beside ``min``/``max``) becomes a bar chart of
the ratios, with the recorded range as error bars and 1.0 marked. Nothing is measured here:
rerun the benchmark a section names to change its numbers, then this script. Needs
matplotlib. Example::

    python benchmarks/plot_doc_ratios.py            # writes docs/bench-ratios-*.png
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import attrs

DOCS = Path(__file__).resolve().parents[1] / "docs"

# section heading -> (figure name, x-axis label)
FIGURES = {
    "The drop-in loader on a plain Dataset": (
        "bench-ratios-dropin.png",
        "throughput, x plain torch DataLoader (paired median, recorded range)",
    ),
    "Reading the peers' formats: MDS, litdata chunks, Megatron indexed files": (
        "bench-ratios-formats.png",
        "ours / the library's own loader (median, min-max)",
    ),
    "Elastic partitions": (
        "bench-ratios-partitions.png",
        "throughput, x one partition per worker (paired median)",
    ),
}

_NUMBER = re.compile(r"(\d+(?:\.\d+)?)x?")


@attrs.frozen
class Ratio:
    """One row of a ratio table: its name, the median, and the recorded range if any."""

    name: str
    median: float
    low: float | None = None
    high: float | None = None


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(_cells(line))
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section of a page (up to the next ``## ``)."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def ratios(text: str) -> list[Ratio]:
    """The rows of the first ratio table of ``text``."""
    for table in _tables(text):
        header = [h.lower() for h in table[0]]
        rows = table[2:]
        column = next((i for i, h in enumerate(header) if h.startswith("x ")), None)
        if column is not None:
            found = []
            for row in rows:
                numbers = [float(n) for n in _NUMBER.findall(row[column])]
                low, high = (numbers[1], numbers[2]) if len(numbers) >= 3 else (None, None)
                found.append(Ratio(row[0].strip("`"), numbers[0], low, high))
            return found
        if {"median", "min", "max"} <= set(header):
            at = {h: header.index(h) for h in ("median", "min", "max")}
            return [
                Ratio(
                    row[0],
                    *(float(_NUMBER.match(row[at[h]]).group(1)) for h in ("median", "min", "max")),  # type: ignore[union-attr]
                )
                for row in rows
            ]
    raise ValueError("no ratio table found (a column 'x ...', or median/min/max)")


def plot(rows: list[Ratio], title: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.4))
    names = [r.name for r in rows]
    errors = [
        [r.median - r.low if r.low is not None else 0 for r in rows],
        [r.high - r.median if r.high is not None else 0 for r in rows],
    ]
    axis.barh(names, [r.median for r in rows], xerr=errors, color="#4c72b0", capsize=3)
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.invert_yaxis()
    axis.set_xlabel(label)
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=DOCS / "benchmarks.md")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the figures")
    args = parser.parse_args(argv)
    text = args.page.read_text()
    for heading, (name, label) in FIGURES.items():
        plot(ratios(section(text, heading)), heading, label, args.out / name)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
