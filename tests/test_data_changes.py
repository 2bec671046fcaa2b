"""Data files rewritten in place between a save and a restore are never silent.

A file source's config carries a fingerprint of its files (``data_files``: relative names,
sizes, sampled content). A restore over files rewritten with other values but the same layout
continues with a ``DataChangedWarning`` naming the source and the file, or refuses with
``on_data_change="refuse"``; a copy of the same files elsewhere (other paths, other times)
restores quietly. The oracle is a file rewritten by hand, as a job re-running its
pre-processing would.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import energy_loader as el
from energy_loader.state import data_fingerprint
from energy_loader.state.data_fingerprint import DataFiles
from tests.helpers import resealed

FIXTURES = Path(__file__).parent / "sources" / "fixtures"


def _swap_equal_rows(path: Path) -> None:
    """Swap the bytes of the first two samples of equal length in an offset-table shard
    (MDS, litdata): other values in each row, the same size and offset table."""
    data = bytearray(path.read_bytes())
    count = int(np.frombuffer(data[:4], "<u4")[0])
    offsets = np.frombuffer(bytes(data[4 : 4 * (count + 2)]), "<u4").astype(int).tolist()
    seen: dict[int, int] = {}
    for row in range(count):
        length = offsets[row + 1] - offsets[row]
        if (
            length in seen
            and data[offsets[row] : offsets[row + 1]]
            != data[offsets[seen[length]] : offsets[seen[length] + 1]]
        ):
            first, second = offsets[seen[length]], offsets[row]
            data[first : first + length], data[second : second + length] = (
                data[second : second + length],
                data[first : first + length],
            )
            path.write_bytes(bytes(data))
            return
        seen[length] = row
    raise AssertionError(f"{path} has no two different samples of one length")


def _reverse_tokens(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[::-1])  # other tokens (read as anything), the same size


def _mds(folder: Path) -> el.SavableDataset:
    return el.MDSSource(folder, cache_dir=folder.parent / "cache")


def _litdata(folder: Path) -> el.SavableDataset:
    return el.LitDataSource(folder, cache_dir=folder.parent / "cache")


def _megatron(folder: Path) -> el.SavableDataset:
    return el.MegatronIndexedSource(folder / "corpus_u16", cache_dir=folder.parent / "cache")


def _chunked(folder: Path) -> el.SavableDataset:
    return el.ChunkedFolderSource(folder)


def _webdataset(folder: Path) -> el.SavableDataset:
    return el.WebDatasetSource(folder, cache_dir=folder.parent / "cache")


def _parquet(folder: Path) -> el.SavableDataset:
    return el.ParquetSource(folder)


def _write_chunked(folder: Path, shift: int = 0) -> None:
    from tests.sources.test_chunked import write_files

    write_files(folder, [6, 5, 7])
    if shift:  # the first file again, other values of the same shapes and dtypes
        torch.save({"i": torch.arange(6) + shift, "x": torch.ones(6, 3) * 2}, folder / "part0.pt")


def _write_webdataset(folder: Path, shift: int = 0) -> None:
    from tests.sources.test_webdataset import members, write_shards

    write_shards(folder, [6, 5, 7])
    if shift:  # sample i + 1's members under sample i's names: the same lengths
        with tarfile.open(folder / "shard-000.tar", "w") as archive:
            for i in range(6):
                for extension, data in members(i + shift):
                    info = tarfile.TarInfo(f"sub/{i:06d}.{extension}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))


def _write_parquet(folder: Path, shift: int = 0) -> None:
    from tests.sources.test_parquet import pa, pq, write_files

    write_files(folder, [6, 5, 7])
    if shift:
        rows = [i + shift for i in range(6)]
        table = pa.table(
            {"i": rows, "text": [f"row {i}" for i in rows], "values": [[i, i] for i in rows]}
        )
        pq.write_table(table, folder / "part-0.parquet", row_group_size=4)


# name: (build, fill the folder, rewrite a file in place, the file named)
CASES: dict[str, tuple[Callable[[Path], el.SavableDataset], Callable[..., None], str]] = {
    "mds": (_mds, lambda f: _swap_equal_rows(f / "shard.00000.mds"), "shard.00000.mds"),
    "litdata": (_litdata, lambda f: _swap_equal_rows(f / "chunk-0-2.bin"), "chunk-0-2.bin"),
    "megatron": (_megatron, lambda f: _reverse_tokens(f / "corpus_u16.bin"), "corpus_u16.bin"),
}
FIXTURE_FOLDERS = {
    "mds": FIXTURES / "mds" / "plain",
    "litdata": FIXTURES / "litdata" / "plain",
    "megatron": FIXTURES / "megatron",
}
WRITTEN = {
    "chunked": (_chunked, _write_chunked, "part0.pt"),
    "webdataset": (_webdataset, _write_webdataset, "shard-000.tar"),
    "parquet": (_parquet, _write_parquet, "part-0.parquet"),
}


def _folder(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    if name in FIXTURE_FOLDERS:
        shutil.copytree(FIXTURE_FOLDERS[name], folder)
    else:
        WRITTEN[name][1](folder)
    return folder


def _rewrite(name: str, folder: Path) -> None:
    if name in CASES:
        CASES[name][1](folder)
    else:
        WRITTEN[name][1](folder, shift=1)


def _build(name: str) -> Callable[[Path], el.SavableDataset]:
    return {**CASES, **WRITTEN}[name][0]


def _loader(name: str, folder: Path, **options) -> el.SavableDataLoader:
    source = _build(name)(folder)
    return el.SavableDataLoader(el.BatchDataset(source, 2, collate_fn=list), **options)


def _keys(batches) -> list:
    return [el.restore_key_of(sample) for batch in batches for sample in batch]


def _saved(name: str, folder: Path) -> tuple[dict, list]:
    loader = _loader(name, folder)
    iterator = iter(loader)
    for _ in range(2):
        next(iterator)
    return loader.save_state_rank(), _keys(iterator)


ALL = [*CASES, *WRITTEN]


@pytest.mark.parametrize("name", ALL)
def test_a_file_rewritten_in_place_warns_naming_it_and_continues(tmp_path, name) -> None:
    folder = _folder(name, tmp_path)
    state, rest = _saved(name, folder)
    _rewrite(name, folder)
    file = {**CASES, **WRITTEN}[name][2]
    refusing = _loader(name, folder, on_data_change="refuse")
    with pytest.raises(el.StateMismatchError, match=rf"data files changed since the save.*{file}"):
        refusing.restore_state_rank(state)
    loader = _loader(name, folder)
    source = type(_build(name)(folder)).__name__
    with pytest.warns(el.DataChangedWarning, match=rf"BatchDataset > {source}: {file}: "):
        loader.restore_state_rank(state)
    assert _keys(loader) == rest  # the saved position, in the new data


@pytest.mark.parametrize("name", ALL)
def test_the_same_files_elsewhere_or_unchanged_restore_quietly(tmp_path, name) -> None:
    folder = _folder(name, tmp_path)
    state, rest = _saved(name, folder)
    moved = shutil.copytree(folder, tmp_path / "elsewhere" / "copy")
    for path in Path(moved).rglob("*"):
        os.utime(path, ns=(10**18, 10**18))  # another machine's times
    for where in (folder, moved):
        loader = _loader(name, Path(where))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loader.restore_state_rank(state)
        assert _keys(loader) == rest


def test_a_state_saved_before_data_fingerprints_restores_quietly(tmp_path) -> None:
    folder = _folder("mds", tmp_path)
    state, rest = _saved("mds", folder)
    older = resealed(state)
    del older["config"]["inner"]["data_files"]
    _rewrite("mds", folder)
    loader = _loader("mds", folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", el.DataChangedWarning)
        loader.restore_state_rank(resealed(older))
    assert _keys(loader) == rest


def test_a_changed_layout_is_refused_naming_the_source_and_the_file(tmp_path) -> None:
    folder = _folder("chunked", tmp_path)
    state, _ = _saved("chunked", folder)
    shutil.rmtree(folder)
    from tests.sources.test_chunked import write_files

    write_files(folder, [6, 6, 7])  # one sample more in the second file
    with pytest.raises(
        el.StateMismatchError,
        match=r"the data files changed since the save, their layout too \(BatchDataset > "
        r"ChunkedFolderSource: part1\.pt: size saved \d+ bytes, now \d+",
    ):
        _loader("chunked", folder).restore_state_rank(state)


def test_on_data_change_takes_warn_or_refuse(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"`on_data_change` must be 'warn'.* or 'refuse'"):
        _loader("chunked", _folder("chunked", tmp_path), on_data_change="ignore")


def test_a_group_names_its_range_and_sampling_reads_the_ends(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data_fingerprint, "GROUPS", 2)
    names = [f"f{i}" for i in range(5)]
    for name in names:
        (tmp_path / name).write_bytes(b"a" * 100)
    saved = DataFiles.local(tmp_path, names).plain
    (tmp_path / "f3").write_bytes(b"b" * 100)
    change = DataFiles.local(tmp_path, names).first_change(saved)
    assert change == "one of the 2 files f3 ... f4: content changed (same total size, 200 bytes)"
    assert DataFiles.local(tmp_path, names[:4]).first_change(saved) == "5 files saved, 4 now"
    # A large file is sampled: its first and last blocks count, a byte between them may not.
    big = tmp_path / "big"
    big.write_bytes(bytes(1 << 20))
    before = DataFiles.local(tmp_path, ["big"]).plain
    with open(big, "r+b") as file:
        file.seek((1 << 20) - 1)
        file.write(b"x")
    assert DataFiles.local(tmp_path, ["big"]).first_change(before) is not None
