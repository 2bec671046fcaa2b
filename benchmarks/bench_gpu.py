"""The GPU input path: uint8 image batches from a map-style dataset into the GPU, per loader.

Each loader (torch's DataLoader, energy_loader's drop-in SavableDataLoader, and torchdata's
StatefulDataLoader when torchdata is importable) runs in a process of its own, with torch's
arguments given alike (batch size, shuffle, workers, pin_memory, prefetch_factor,
persistent_workers). A training-style loop moves every batch to the device with
``.to(device, non_blocking=True)`` (and, with ``--model``, runs a bf16 forward and backward
step of a torchvision model on it); after the warm-up steps, at least 200 steps are timed
(more than the batches the workers prefetch, which would otherwise inflate the rate), the
device synchronized at both ends. Beside them, the CPU ceiling: the single-core cost of one
sample (measured in a process of its own, one thread) times the number of workers, the most
samples per second the workers can make whatever the loader. The table names the machine (GPU,
CPU count, torch).

The dataset is synthetic: each sample is a uint8 image (3 x SIZE x SIZE, from a shared random
image rolled by the index, flipped on odd indices) made after a busy loop of ``--work-ms`` ms,
the stand-in for decoding and augmenting. Run::

    python benchmarks/bench_gpu.py                               # 256 x 3 x 224 x 224, cuda
    python benchmarks/bench_gpu.py --model resnet50              # with model steps
    python benchmarks/bench_gpu.py --device cpu --batch 8 --image 32 --steps 20 --warmup 2 \\
        --workers 2 --work-ms 0.2                                 # a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

LOADERS = ("torch DataLoader", "SavableDataLoader", "torchdata StatefulDataLoader")
_DESCRIPTION = (__doc__ or "").split("\n\n")[0].replace("\n", " ")


class SyntheticImages(Dataset[Any]):
    """``length`` uint8 images of 3 x ``size`` x ``size``; each costs ``work_ms`` of CPU (a busy
    loop) plus a roll and a flip of a shared random image."""

    def __init__(self, length: int, size: int, work_ms: float) -> None:
        self.length, self.size, self.work_s = length, size, work_ms / 1e3
        generator = torch.Generator().manual_seed(0)
        self.base = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        began = time.perf_counter()
        while time.perf_counter() - began < self.work_s:
            pass
        image = torch.roll(self.base, shifts=index % self.size, dims=2)
        if index % 2:
            image = image.flip(2)
        return {"image": image.contiguous(), "label": index % 1000}


def _loader_class(name: str) -> Any:
    if name == "torch DataLoader":
        return DataLoader
    if name == "SavableDataLoader":
        import energy_loader as el

        return el.SavableDataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


def torchdata_available() -> bool:
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return False
    return True


def _model_step(name: str, device: str) -> Any:
    """A function that runs one bf16 training step of torchvision's ``name`` on a batch."""
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=1000).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        inputs = images.float().div_(255).contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_loader(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--warmup`` untimed steps, then ``--steps`` timed ones of loader ``name``: samples/s."""
    length = (args.warmup + args.steps) * args.batch
    pin = args.device.startswith("cuda")
    loader = _loader_class(name)(
        SyntheticImages(length, args.image, args.work_ms),
        batch_size=args.batch,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=pin,
        prefetch_factor=args.prefetch if args.workers else None,
        persistent_workers=args.workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    step = None if args.model == "none" else _model_step(args.model, args.device)
    iterator = iter(loader)
    began = 0.0
    pinned = True
    for number in range(args.warmup + args.steps):
        if number == args.warmup:
            _synchronize(args.device)
            began = time.perf_counter()
        batch = next(iterator)
        pinned &= not pin or batch["image"].is_pinned()
        images = batch["image"].to(args.device, non_blocking=True)
        labels = batch["label"].to(args.device, non_blocking=True)
        if step is not None:
            step(images, labels)
        else:
            images.sum()  # the batch is used on the device: the copy has to land
    _synchronize(args.device)
    elapsed = time.perf_counter() - began
    del iterator
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return {
        "loader": name,
        "samples_per_s": args.steps * args.batch / elapsed,
        "steps_per_s": args.steps / elapsed,
        "pinned": pinned if pin else None,
    }


def sample_cost(args: argparse.Namespace, samples: int = 200) -> dict[str, Any]:
    """The single-core cost of one sample (one thread, after 10 untimed samples): seconds."""
    torch.set_num_threads(1)
    dataset = SyntheticImages(samples + 10, args.image, args.work_ms)
    for index in range(10):
        dataset[index]
    began = time.perf_counter()
    for index in range(10, samples + 10):
        dataset[index]
    return {"sample_s": (time.perf_counter() - began) / samples}


def machine(device: str) -> str:
    """The GPU's name (or the device), the CPU count and torch's version."""
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    else:
        gpu = f"no GPU (device {device})"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{gpu}; {os.cpu_count()} CPUs ({usable} usable); torch {torch.__version__}"


def _child(args: argparse.Namespace, what: str) -> dict[str, Any]:
    """Run ``what`` (a loader's name, or ``ceiling``) in a new process; its JSON result."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", what]
    for name, value in vars(args).items():
        if name not in ("child", "json"):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=args.child_timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{what}: exit code {result.returncode}\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def format_table(summary: dict[str, Any]) -> str:
    """The results as a Markdown table, the machine and the settings above it."""
    ceiling = summary["ceiling_samples_per_s"]
    lines = [
        f"machine: {summary['machine']}",
        f"settings: {summary['settings']}",
        f"CPU ceiling: {summary['sample_ms']:.3f} ms a sample on one core x "
        f"{summary['workers']} workers = {ceiling:,.0f} samples/s",
        "",
        "| loader | samples/s (median) | steps/s | x torch (paired median, range) "
        "| % of CPU ceiling | batches pinned |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, row in summary["loaders"].items():
        if "skipped" in row:
            lines.append(f"| {name} | not run: {row['skipped']} | | | | |")
            continue
        ratios = row["x_torch"]
        lines.append(
            f"| {name} | {row['samples_per_s']:,.0f} | {row['steps_per_s']:.2f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{100 * row['samples_per_s'] / ceiling:.0f}% | "
            f"{'- (no pin_memory off CUDA)' if row['pinned'] is None else row['pinned']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=_DESCRIPTION)
    parser.add_argument(
        "--device", default="cuda", help="where batches go: cuda, cuda:N or cpu (default cuda)"
    )
    parser.add_argument("--batch", type=int, default=256, help="images a batch (default 256)")
    parser.add_argument(
        "--image", type=int, default=224, help="image side: 3 x N x N uint8 (default 224)"
    )
    parser.add_argument(
        "--work-ms",
        type=float,
        default=2.0,
        help="busy CPU time of one sample, the stand-in for decoding (default 2.0 ms)",
    )
    parser.add_argument("--workers", type=int, default=12, help="loader workers (default 12)")
    parser.add_argument(
        "--prefetch", type=int, default=2, help="prefetch_factor, batches a worker (default 2)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help="timed steps after the warm-up (default 200; must exceed workers x prefetch)",
    )
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument(
        "--model",
        default="none",
        help="a torchvision model to train a bf16 step of on each batch, e.g. resnet50 "
        "(default none: the batch is only moved to the device and summed there)",
    )
    parser.add_argument(
        "--repetitions",
        type=int,
        default=3,
        help="runs of every loader, in alternating order (default 3)",
    )
    parser.add_argument(
        "--child-timeout",
        type=float,
        default=600,
        help="seconds one loader's process may take (default 600)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("batch", "image", "steps", "repetitions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.workers < 0 or args.warmup < 0 or args.prefetch < 1 or args.work_ms < 0:
        parser.error("--workers, --warmup and --work-ms must be >= 0, --prefetch >= 1")
    if args.steps <= args.workers * args.prefetch:
        parser.error(
            f"--steps {args.steps} must exceed the batches prefetched "
            f"({args.workers} workers x {args.prefetch}): they would inflate the rate"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; run with --device cpu on this machine")
    if args.model != "none":
        try:
            import torchvision.models
        except ImportError:
            parser.error(f"--model {args.model} needs torchvision, which is not installed")
        if not hasattr(torchvision.models, args.model):
            parser.error(f"--model {args.model}: torchvision.models has no such model")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "ceiling":
        print(json.dumps(sample_cost(args)))
        return 0
    if args.child is not None:
        print(json.dumps(run_loader(args.child, args)))
        return 0
    loaders = [name for name in LOADERS if name != LOADERS[2] or torchdata_available()]
    if LOADERS[2] not in loaders:
        print(
            "torchdata is not installed: no StatefulDataLoader row (pip install torchdata to "
            "compare it)",
            flush=True,
        )
    cost = _child(args, "ceiling")["sample_s"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    for repetition in range(args.repetitions):
        order = loaders if repetition % 2 == 0 else loaders[::-1]
        for name in order:
            runs[name].append(_child(args, name))
        plain = runs[LOADERS[0]][-1]["samples_per_s"]
        print(
            f"repetition {repetition + 1}: "
            + ", ".join(f"{n} {runs[n][-1]['samples_per_s'] / plain:.2f}x" for n in loaders),
            flush=True,
        )
    rows: dict[str, Any] = {}
    for name in LOADERS:
        if name not in runs:
            rows[name] = {"skipped": "torchdata is not installed"}
            continue
        results = runs[name]
        rows[name] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in results),
            "steps_per_s": statistics.median(r["steps_per_s"] for r in results),
            "x_torch": [
                r["samples_per_s"] / p["samples_per_s"] for r, p in zip(results, runs[LOADERS[0]])
            ],
            "pinned": None if results[0]["pinned"] is None else all(r["pinned"] for r in results),
            "runs": results,
        }
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "json", "child_timeout")}
    summary = {
        "machine": machine(args.device),
        "settings": settings,
        "workers": args.workers,
        "sample_ms": cost * 1e3,
        "ceiling_samples_per_s": max(1, args.workers) / cost,
        "loaders": rows,
    }
    print("\n" + format_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
