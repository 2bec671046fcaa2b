"""The ``vision`` bench workload: JPEGs from WebDataset tars -> Pillow decode -> random resized
crop to 224 and random horizontal flip (torch ops) -> batches of 64.

The per-sample work is :func:`decode_and_augment`, the same function for every contender, over
a sample's raw members (``{"jpg": bytes, "cls": bytes}``). Its random draws (crop box, flip)
come from torch's default generator, or from the ``generator`` a library hands it (Grain gives
each element its own RNG). A batch is ``{"image": uint8 [B, 3, 224, 224], "label": int64 [B]}``
(plus the restore keys on our side); :func:`fingerprint` hashes the pixels and the labels, so
equal fingerprints mean the same images, pixel for pixel, after the same augmentation.

- energy_loader: :class:`~energy_loader.WebDatasetSource` (shuffled, members left as bytes) ->
  :class:`MapDataset` (``decode_and_augment``, per-sample seeding on: the augmentation is a
  function of the sample) -> :class:`BatchDataset` of 64;
- the plain torch ``DataLoader``: ``webdataset.WebDataset`` as its README shows (shard
  shuffle, a 1,000-sample shuffle buffer, ``.map(decode_and_augment)``), batched 64 by the
  loader (the torchdata peer of the repository's ``benchmarks/peers/`` runs the same dataset).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .data import tar_shards

__all__ = [
    "BATCH",
    "LOADER_OPTIONS",
    "SIZE",
    "count",
    "decode_and_augment",
    "fingerprint",
    "plain_loader",
    "vision_pipeline",
    "wds_dataset",
]

SIZE = 224
BATCH = 64
WORKERS = 2
PREFETCH = 2
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
WDS_SHUFFLE = 1000
# The plain DataLoader's arguments; a peer's loader over the same dataset takes them too.
LOADER_OPTIONS: Mapping[str, Any] = MappingProxyType(
    dict(batch_size=BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH, persistent_workers=True)
)


def _crop_box(height: int, width: int, generator: torch.Generator | None) -> tuple[int, ...]:
    """``(top, left, h, w)`` of a random resized crop (torchvision's ``get_params``)."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*SCALE, generator=generator).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio, generator=generator).item())
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator).item())
            return top, left, h, w
    # Fallback: the largest central crop within the ratio bounds.
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def decode_and_augment(
    sample: dict[str, Any], generator: torch.Generator | None = None
) -> dict[str, Any]:
    """Decode ``sample["jpg"]`` with Pillow, random-resized-crop it to 224 x 224 and flip it
    horizontally with probability 1/2: ``{"image": uint8 [3, 224, 224], "label": int}``."""
    from PIL import Image

    with Image.open(io.BytesIO(sample["jpg"])) as picture:
        pixels = torch.from_numpy(np.array(picture.convert("RGB")))
    image = pixels.permute(2, 0, 1)
    top, left, h, w = _crop_box(image.shape[1], image.shape[2], generator)
    crop = image[:, top : top + h, left : left + w].unsqueeze(0)
    resized = F.interpolate(crop, size=(SIZE, SIZE), mode="bilinear", antialias=True)[0]
    if torch.rand(1, generator=generator).item() < 0.5:
        resized = resized.flip(-1)
    label = sample["cls"]
    return {"image": resized.contiguous(), "label": int(label)}


def count(batch: dict[str, Any]) -> float:
    """Images in a batch."""
    return float(len(batch["label"]))


def fingerprint(batch: dict[str, Any]) -> str:
    """A digest of a batch's pixels and labels: equal iff the same augmented images."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(batch["image"].contiguous().numpy().tobytes())
    digest.update(torch.as_tensor(batch["label"]).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def vision_pipeline(folder: Path, seed: int = 0, *, seed_per_sample: bool = True) -> Any:
    """The workload as an energy_loader pipeline over the tar shards in ``folder``."""
    from energy_loader.sources import WebDatasetSource
    from energy_loader.wrappers import BatchDataset, MapDataset

    source = WebDatasetSource(tar_shards(folder), shuffle=True, seed=seed, decode=False)
    images = MapDataset(source, decode_and_augment, seed_per_sample=seed_per_sample)
    return BatchDataset(images, BATCH)


def wds_dataset(folder: Path, seed: int = 0) -> Any:
    """``webdataset.WebDataset`` over the shards, as its README shows."""
    import webdataset as wds

    return (
        wds.WebDataset(tar_shards(folder), shardshuffle=len(tar_shards(folder)), seed=seed)
        .shuffle(WDS_SHUFFLE)
        .map(decode_and_augment)
    )


def plain_loader(folder: Path) -> DataLoader:
    """A torch ``DataLoader`` over :func:`wds_dataset`."""
    return DataLoader(wds_dataset(folder), **LOADER_OPTIONS)
