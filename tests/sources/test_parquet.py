"""ParquetSource: row groups, local shuffle, global order, resume with workers, damaged files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import energy_loader as el
from energy_loader import ParquetSource, SourceDataError
from energy_loader.rng import stable_hash
from energy_loader.sources import FeistelPermutation
from energy_loader.sources._order import EpochOrder
from energy_loader.testing import check_resume
from energy_loader.worker import WorkerContext
from tests.helpers import LazyModule
from tests.sources.helpers import assert_readers_interleave, keys_of

# pyarrow is imported by the first test that runs, not at collection (LazyModule says why).
pa = LazyModule("pyarrow")
pq = LazyModule("pyarrow.parquet")


def write_files(directory: Path, sizes: list[int], row_group_size: int = 4) -> int:
    """Parquet files of ``sizes`` rows (columns i, text, values), row groups of 4 rows."""
    directory.mkdir(parents=True, exist_ok=True)
    first = 0
    for number, size in enumerate(sizes):
        rows = range(first, first + size)
        table = pa.table(
            {
                "i": list(rows),
                "text": [f"row {i}" for i in rows],
                "values": [[i, i + 1] for i in rows],
            }
        )
        pq.write_table(table, directory / f"part-{number}.parquet", row_group_size=row_group_size)
        first += size
    return first


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Three files of 10, 7 and 13 rows (30 in all) in row groups of up to 4 rows."""
    directory = tmp_path_factory.mktemp("parquet")
    write_files(directory, [10, 7, 13])
    return directory


def test_rows_in_order_and_restorable(files):
    source = ParquetSource(files)
    got = list(source)
    assert [row["i"] for row in got] == list(range(30)) and len(source) == 30
    assert got[12]["text"] == "row 12" and got[12]["values"] == [12, 13]
    assert got[12][el.RESTORE_KEY] == (1, 0, 2)
    assert source.restore_sample((1, 0, 2)) == {"i": 12, "text": "row 12", "values": [12, 13]}
    narrow = ParquetSource(sorted(files.glob("*.parquet")), columns=["text"])
    assert next(iter(narrow)) == {"text": "row 0", el.RESTORE_KEY: (0, 0, 0)}


def test_shuffle_is_local_per_epoch_and_seeded(files):
    source = ParquetSource(files, shuffle=True, seed=2, shuffle_window=2)
    first = keys_of(source)
    second = [key for key, _ in source.iter_keyed()]
    assert sorted(first) == sorted(second) == sorted(keys_of(ParquetSource(files)))
    assert first != second
    assert keys_of(ParquetSource(files, shuffle=True, seed=3, shuffle_window=2)) != first
    # Rows move within windows of 2 row groups, read one window after the other.
    order = source.epoch_order(0)
    assert all(len(window) <= 2 for window in order.windows)
    window_of = {
        source.row_groups[group]: number
        for number, window in enumerate(order.windows)
        for group in window
    }
    assert [window_of[key[:2]] for key in first] == sorted(window_of[key[:2]] for key in first)


def test_each_row_group_is_decoded_about_once_per_epoch(files, monkeypatch):
    source = ParquetSource(files, shuffle=True, seed=1, shuffle_window=3)
    reads: list[int] = []
    held_at_reads: list[int] = []
    original = source._read

    def read(group: int) -> object:
        reads.append(group)
        held_at_reads.append(sum(len(groups) for groups in source._cache))
        return original(group)

    monkeypatch.setattr(source, "_read", read)
    keys_of(source)
    assert sorted(reads) == list(range(len(source.row_groups)))
    # One span is read window after window: the previous window is freed before the next is
    # decoded, so no more than the window being decoded is ever held.
    assert max(held_at_reads) == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_is_the_same_for_any_number_of_readers(files, shuffle):
    source = ParquetSource(files, shuffle=shuffle, seed=5, num_canonical_partitions=4)
    expected = source.global_order(epoch=0)
    assert len(set(expected)) == 30
    assert_readers_interleave(source, expected, [(1, 1), (2, 1), (1, 4), (2, 2), (3, 1)])


def reference_order(source: ParquetSource, epoch: int, partitions: int) -> list[tuple[int, ...]]:
    """The documented global order, one position at a time: row groups permuted, rows
    permuted within windows of ``shuffle_window`` row groups, the sequence cut into spans."""
    seed = stable_hash(source.seed, source.stream_salt(), epoch)
    sizes = source.row_group_rows
    count = len(sizes)
    groups, width = list(range(count)), 1
    if source.shuffle and count > 1:
        permutation = FeistelPermutation(count, stable_hash(seed, "row-groups"))
        groups, width = [permutation[i] for i in range(count)], source.shuffle_window
    windows = [groups[i : i + width] for i in range(0, count, width)]
    rows = [[(g, r) for g in window for r in range(sizes[g])] for window in windows]
    order = EpochOrder(
        [len(w) for w in rows], seed, source.shuffle, partitions, shuffle_units=False
    )
    keys = []
    for position in range(source.total):
        window, row = order.key(position)
        group, row = rows[window][row]
        keys.append((*source.row_groups[group], row))
    return keys


@given(
    shuffle=st.booleans(),
    window=st.integers(1, 5),
    partitions=st.integers(1, 6),
    epoch=st.integers(0, 3),
)
def test_global_order_is_the_documented_one(files, shuffle, window, partitions, epoch):
    source = ParquetSource(files, shuffle=shuffle, seed=9, shuffle_window=window)
    assert source.global_order(epoch, partitions) == reference_order(source, epoch, partitions)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(files, num_workers, no_leftover_processes):
    check_resume(
        lambda: ParquetSource(files, shuffle=True, seed=4, num_canonical_partitions=4).batch(4),
        num_workers=num_workers,
    )


@given(stop=st.integers(0, 32), window=st.integers(1, 5))
def test_resume_property(files, stop, window):
    check_resume(
        lambda: ParquetSource(files, shuffle=True, seed=7, shuffle_window=window),
        stop_points=[stop],
    )


FILE_SIZES = [10, 7, 13]  # the ``files`` fixture


def written_row(key: tuple[int, int, int]) -> dict:
    """The row ``write_files`` wrote at ``(file, row group, row)``, in row groups of 4."""
    file, group, row = key
    i = sum(FILE_SIZES[:file]) + 4 * group + row
    return {"i": i, "text": f"row {i}", "values": [i, i + 1]}


@given(
    shuffle=st.booleans(),
    window=st.integers(1, 5),
    partitions=st.integers(1, 6),
    readers=st.integers(1, 4),
)
def test_every_row_read_is_the_row_its_key_names(files, shuffle, window, partitions, readers):
    # Readers of several spans (partitions != readers) read blocks that mix windows.
    source = ParquetSource(
        files, shuffle=shuffle, seed=3, shuffle_window=window, num_canonical_partitions=partitions
    )
    seen = []
    for reader in range(readers):
        source.bind(WorkerContext(partition=reader, num_partitions=readers))
        source.reset_state()
        for key, row in source.iter_keyed():
            assert row == written_row(key), key
            seen.append(key)
    assert sorted(seen) == sorted(source.global_order(0, partitions))


def test_files_whose_schemas_differ_keep_their_own_columns_and_types(tmp_path):
    pq.write_table(
        pa.table({"i": pa.array(range(6), pa.int64()), "text": [f"a{i}" for i in range(6)]}),
        tmp_path / "a.parquet",
        row_group_size=2,
    )
    pq.write_table(
        pa.table(
            {
                "i": pa.array(range(6, 12), pa.int32()),
                "text": [f"b{i}" for i in range(6, 12)],
                "extra": [i / 2 for i in range(6, 12)],
            }
        ),
        tmp_path / "b.parquet",
        row_group_size=2,
    )
    written = [pq.read_table(tmp_path / name).to_pylist() for name in ("a.parquet", "b.parquet")]
    # Windows of 6 row groups: each holds row groups of both files.
    source = ParquetSource(tmp_path, shuffle=True, seed=1, shuffle_window=6)
    rows = list(source)
    assert len(rows) == 12
    for row in rows:
        file, group, number = row.pop(el.RESTORE_KEY)
        assert row == written[file][2 * group + number]


def damage_row_group(path: Path, group: int) -> None:
    """Scramble every byte of row group ``group``'s column chunks, and nothing else."""
    metadata = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for number in range(metadata.num_columns):
        chunk = metadata.column(number)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        for offset in range(start, start + chunk.total_compressed_size):
            data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_damaged_row_group_in_a_shuffled_window_stops_at_its_first_row(tmp_path):
    write_files(tmp_path, [24])  # six row groups of 4 rows, windows of 3
    path = tmp_path / "part-0.parquet"
    good = path.read_bytes()

    def make() -> el.SavableDataLoader:
        return el.SavableDataLoader(ParquetSource(tmp_path, shuffle=True, seed=5, shuffle_window=3))

    clean = [row[el.RESTORE_KEY] for row in make()]
    first_needed: dict[int, int] = {}
    for position, key in enumerate(clean):
        first_needed.setdefault(key[1], position)
    # The first window's last row group to be needed: rows of the window's other two row
    # groups come before its first row and after it.
    damaged_group = sorted(first_needed, key=first_needed.__getitem__)[2]
    cut = first_needed[damaged_group]
    damage_row_group(path, damaged_group)
    loader = make()
    keys, state = [], loader.save_state_rank()
    with pytest.raises(SourceDataError, match=rf"part-0\.parquet, row group {damaged_group}"):
        for row in loader:
            keys.append(row[el.RESTORE_KEY])
            state = loader.save_state_rank()
    assert keys == clean[:cut] and 0 < cut < 12
    path.write_bytes(good)  # repaired: the run continues from its last save
    restored = make()
    restored.restore_state_rank(state)
    assert [row[el.RESTORE_KEY] for row in restored] == clean[cut:]


def test_reading_in_a_worker_does_not_import_pandas(files):
    # pyarrow imports pandas (~0.5 s of CPU) when handed numpy arrays it could wrap.
    script = textwrap.dedent(
        """
        import sys
        import energy_loader as el

        def pandas_loaded(row):
            return "pandas" in sys.modules

        assert "pandas" not in sys.modules
        source = el.ParquetSource(sys.argv[1], shuffle=True, seed=1)
        loader = el.SavableDataLoader(source.map(pandas_loaded), num_workers=1)
        print(sorted(set(loader)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(files)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "[False]"


def test_a_corrupt_footer_is_named(tmp_path):
    write_files(tmp_path, [5, 5])
    path = tmp_path / "part-1.parquet"
    data = bytearray(path.read_bytes())
    data[-12:-4] = b"\xff" * 8  # the footer length and the end of the footer
    path.write_bytes(bytes(data))
    with pytest.raises(SourceDataError, match=r"part-1\.parquet is not a readable Parquet file"):
        ParquetSource(tmp_path)


def test_a_corrupt_row_group_is_a_worker_error(tmp_path, no_leftover_processes):
    write_files(tmp_path, [8], row_group_size=8)
    path = tmp_path / "part-0.parquet"
    source = ParquetSource(tmp_path)
    data = bytearray(path.read_bytes())
    for offset in range(8, 200):  # the column chunks, after the magic
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    loader = el.SavableDataLoader(source, num_workers=2)
    with pytest.raises(el.WorkerError, match=r"part-0\.parquet, row group 0"):
        list(loader)
    del loader


def test_rows_before_a_damaged_row_group_come_first_and_resume_is_exact(tmp_path):
    write_files(tmp_path, [16], row_group_size=8)
    path = tmp_path / "part-0.parquet"
    good = path.read_bytes()
    second = pq.ParquetFile(path).metadata.row_group(1)
    start = min(second.column(c).data_page_offset for c in range(second.num_columns))
    damaged = bytearray(good)
    for offset in range(start, start + 64):
        damaged[offset] ^= 0x5A
    path.write_bytes(bytes(damaged))
    loader = el.SavableDataLoader(ParquetSource(tmp_path))
    rows, iterator = [], iter(loader)
    with pytest.raises(SourceDataError, match=r"part-0\.parquet, row group 1"):
        for row in iterator:
            rows.append(row["i"])
            state = loader.save_state_rank()
    assert rows == list(range(8))
    path.write_bytes(good)  # repaired: the run continues from its last save
    restored = el.SavableDataLoader(ParquetSource(tmp_path))
    restored.restore_state_rank(state)
    assert [row["i"] for row in restored] == list(range(8, 16))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shuffle": "yes"}, TypeError, "`shuffle` must be True or False"),
        ({"seed": -2}, ValueError, "`seed` must be >= 0"),
        ({"shuffle_window": 0}, ValueError, "`shuffle_window` must be positive"),
        ({"max_cached_row_groups": 0}, ValueError, "`max_cached_row_groups` must be positive"),
        ({"columns": "text"}, TypeError, "`columns` must be a list"),
        ({"columns": ["nope"]}, ValueError, r"`columns` \['nope'\] are not in"),
        ({"read_retries": -1}, ValueError, "`read_retries` must be >= 0"),
    ],
)
def test_bad_arguments(files, kwargs, error, message):
    with pytest.raises(error, match=message):
        ParquetSource(files, **kwargs)


def test_bad_locations_and_keys(files, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no \.parquet files"):
        ParquetSource(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a Parquet file nor a directory"):
        ParquetSource(tmp_path / "missing")
    with pytest.raises(TypeError, match="`paths_or_dir` must be"):
        ParquetSource(3)
    source = ParquetSource(files)
    for key in [(0, 3, 0), (0, 0, 4), (3, 0, 0), (0, 0), ("0", 0, 0)]:
        with pytest.raises(ValueError, match=r"restore keys are \(file, row_group, row\)"):
            source.restore_sample(key)
