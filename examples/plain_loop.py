"""The README example: a training-like loop that saves and restores the loader exactly.

Run: python examples/plain_loop.py
"""

from __future__ import annotations

import os
import tempfile

import torch

import energy_loader as el


def make_sample(index: int) -> dict:
    return {"index": index, "tokens": torch.arange(64) + index}


def tokenize(sample: dict) -> dict:
    noise = torch.randint(0, 3, (64,))  # random augmentation: reproduced after a restore
    return {**sample, "tokens": sample["tokens"] * 7 % 50257 + noise}


def build_pipeline() -> el.SavableDataset:
    source = el.IndexedSource.from_fn(length=2_000, fn=make_sample, shuffle=True, seed=1234)
    return el.BatchDataset(
        el.ShuffleBufferDataset(el.MapDataset(source, tokenize), size=100), batch_size=32
    )


def main() -> None:
    path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    loader = el.SavableDataLoader(build_pipeline(), num_workers=2)
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch["index"].tolist())
        if step == 20:
            torch.save({"data": loader.state_dict()}, path)
        if step == 30:
            break  # a preemption
    loader = el.SavableDataLoader(build_pipeline(), num_workers=2)
    loader.load_state_dict(torch.load(path, weights_only=True)["data"])
    resumed = [batch["index"].tolist() for batch in loader]
    uninterrupted = [
        batch["index"].tolist() for batch in el.SavableDataLoader(build_pipeline(), num_workers=2)
    ]
    assert seen[:21] + resumed == uninterrupted
    print(f"resumed exactly: {len(seen[:21])} + {len(resumed)} batches == {len(uninterrupted)}")


if __name__ == "__main__":
    main()
