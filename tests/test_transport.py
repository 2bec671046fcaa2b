"""The batch codec and the shared-memory arenas (energy_loader/transport/)."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
import signal
import threading
import time
import warnings
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import energy_loader as el
from energy_loader.testing import check_resume, record_events
from energy_loader.testing.compare import first_difference
from energy_loader.testing.strategies import PipelineSpec, pipelines
from energy_loader.transport import (
    DEFAULT_INLINE_BYTES,
    Arena,
    Encoder,
    Packet,
    batch_tensor,
    decode,
    validate_transport_settings,
)
from energy_loader.transport._reserved import collate_into
from tests.helpers import indices, reference_pipeline

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ARENA_ONLY = {"transport_inline_bytes": 0}


def _through_queue(packet: Packet) -> Any:
    """What torch's result queue does to an item: ForkingPickler out, pickle back in."""
    return pickle.loads(ForkingPickler.dumps(packet))


def _round_trip(item: Any, encoder: Encoder) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. frombuffer's "buffer is not writable"
        return decode(_through_queue(encoder.encode(item)))


@pytest.fixture(scope="module")
def arena() -> Any:
    ring = Arena(1 << 22)
    yield ring
    ring.close()


# -- random structures -------------------------------------------------------------------

TENSOR_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.uint16, torch.float8_e4m3fn,
]  # fmt: skip
ARRAY_DTYPES = [
    np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]  # fmt: skip
LAYOUTS = ["contiguous", "transposed", "strided", "expanded", "offset", "conj"]


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    generator = np.random.default_rng(seed)
    return np.asarray(generator.integers(-100, 100, size=shape) / 4, dtype=np.float64)


def _relayout(value: Any, layout: str) -> Any:
    """The same kind of object, laid out in memory the way ``layout`` says."""
    if value.ndim == 0:
        return value
    if layout == "transposed" and value.ndim >= 2:
        return value.swapaxes(0, 1) if isinstance(value, np.ndarray) else value.transpose(0, 1)
    if layout == "strided":
        return value[::2]
    if layout == "offset":
        return value[1:]
    if layout == "expanded" and isinstance(value, torch.Tensor) and value.shape[0] == 1:
        return value.expand(3, *value.shape[1:])
    if layout == "conj" and isinstance(value, torch.Tensor) and value.is_complex():
        return value.conj()
    return value


@st.composite
def leaves(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["tensor", "array", "plain"]))
    if kind == "plain":
        return draw(
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(),
                st.floats(allow_nan=False),
                st.text(max_size=5),
                st.binary(max_size=5),
            )
        )
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    values = _values(shape, draw(st.integers(0, 2**16)))
    layout = draw(st.sampled_from(LAYOUTS))
    if kind == "array":
        return _relayout(values.astype(draw(st.sampled_from(ARRAY_DTYPES))), layout)
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    return _relayout(torch.from_numpy(values).to(dtype), layout)


structures = st.recursive(
    leaves(),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=8,
)


def _check_same_kinds(original: Any, decoded: Any) -> None:
    """Types, dtypes and shapes kept; tensors and arrays contiguous and writable."""
    assert type(decoded) is type(original)
    if isinstance(original, torch.Tensor):
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        assert decoded.is_contiguous()
    elif isinstance(original, np.ndarray):
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        assert decoded.flags.writeable
    elif isinstance(original, dict):
        for key in original:
            _check_same_kinds(original[key], decoded[key])
    elif isinstance(original, (list, tuple)):
        for a, b in zip(original, decoded):
            _check_same_kinds(a, b)


@settings(max_examples=60)
@given(item=structures, through_arena=st.booleans())
def test_decoded_items_equal_the_originals(item: Any, through_arena: bool, arena: Arena) -> None:
    encoder = Encoder(0 if through_arena else 1 << 40, arena)
    decoded = _round_trip(item, encoder)
    assert first_difference(item, decoded) is None, first_difference(item, decoded)
    _check_same_kinds(item, decoded)


def test_every_dtype_layout_and_empty_shape_round_trips(arena: Arena) -> None:
    for dtype in TENSOR_DTYPES:
        for shape in [(), (0,), (3, 0), (2, 3)]:
            for layout in LAYOUTS:
                tensor = _relayout(torch.from_numpy(_values(shape, 1)).to(dtype), layout)
                for threshold in (0, 1 << 40):
                    decoded = _round_trip({"t": tensor}, Encoder(threshold, arena))["t"]
                    assert first_difference(tensor, decoded) is None, (dtype, shape, layout)
                    _check_same_kinds(tensor, decoded)


def test_decoded_memory_is_writable_and_shared_between_views(arena: Arena) -> None:
    item = {"tokens": torch.arange(12).reshape(3, 4), "array": np.arange(4.0)}
    for threshold in (0, 1 << 40):
        decoded = _round_trip(item, Encoder(threshold, arena))
        decoded["tokens"] += 1
        decoded["array"][0] = 7
        assert int(decoded["tokens"][0, 0]) == 1 and decoded["array"][0] == 7
        assert int(item["tokens"][0, 0]) == 0 and item["array"][0] == 0


def test_tensor_attributes_such_as_restore_keys_survive(arena: Arena) -> None:
    tensor = torch.arange(3)
    tensor.__restore_key__ = ("source", 5)
    decoded = _round_trip([tensor], Encoder(0, arena))[0]
    assert decoded.__restore_key__ == ("source", 5)


def test_tensors_the_codec_does_not_handle_keep_torchs_reduction(arena: Arena) -> None:
    leaf = torch.ones(3, requires_grad=True)
    parameter = torch.nn.Parameter(torch.zeros(2))
    sparse = torch.eye(3).to_sparse()
    item = {"leaf": leaf, "parameter": parameter, "sparse": sparse}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own sparse-rebuild warning
        decoded = decode(_through_queue(Encoder(0, arena).encode(item)))
    assert decoded["leaf"].requires_grad and torch.equal(decoded["leaf"], leaf)
    assert type(decoded["parameter"]) is torch.nn.Parameter
    assert torch.equal(decoded["sparse"].to_dense(), torch.eye(3))


def test_tensordict_round_trips_when_installed(arena: Arena) -> None:
    tensordict = pytest.importorskip("tensordict")
    data = tensordict.TensorDict(
        {"a": torch.arange(6).reshape(3, 2), "nested": {"b": torch.ones(3, dtype=torch.bfloat16)}},
        batch_size=[3],
    )
    for threshold in (0, 1 << 40):
        decoded = _round_trip(data, Encoder(threshold, arena))
        assert isinstance(decoded, tensordict.TensorDict)
        assert decoded.batch_size == data.batch_size
        assert torch.equal(decoded["a"], data["a"])
        assert torch.equal(decoded["nested", "b"], data["nested", "b"])


class _LateRegistered:
    def __init__(self, value: int) -> None:
        self.value = value


def _rebuild_late_registered(value: int) -> tuple[str, int]:
    return ("rebuilt by its reduction", value)


def test_a_reduction_registered_after_the_first_item_is_honoured() -> None:
    encoder = Encoder(1 << 40, None)
    assert _round_trip([1, 2], encoder) == [1, 2]  # the pickler's table is built now
    ForkingPickler.register(_LateRegistered, lambda obj: (_rebuild_late_registered, (obj.value,)))
    try:
        assert _round_trip([_LateRegistered(3)], encoder) == [("rebuilt by its reduction", 3)]
    finally:
        del ForkingPickler._extra_reducers[_LateRegistered]


def test_pin_memory_hook_decodes_and_degrades_gracefully_without_an_accelerator(
    arena: Arena,
) -> None:
    item = {"x": torch.arange(5)}
    for threshold in (0, 1 << 40):
        pinned = _through_queue(Encoder(threshold, arena).encode(item)).pin_memory()
        assert pinned.pin_memory() is pinned
        decoded = decode(pinned)
        assert torch.equal(decoded["x"], item["x"])
        assert decoded["x"].is_pinned() == torch.accelerator.is_available()


# -- the arena ---------------------------------------------------------------------------


def _take(ring: Arena, slot: tuple[int, int], size: int) -> None:
    ring.take(slot[0], slot[1], np.empty(size, dtype=np.uint8))


def test_arena_keeps_to_its_front() -> None:
    ring = Arena(1 << 20)
    try:
        size, in_flight, offsets = 10_000, 3, set()
        slots = [ring.reserve(size) for _ in range(in_flight)]
        for _ in range(200):
            _take(ring, slots.pop(0), size)
            slots.append(ring.reserve(size))
            offsets.add(slots[-1][0])
        # A sliding window of 3 payloads stays within a few payloads of the front.
        assert max(offsets) < 2 * (in_flight + 1) * size, sorted(offsets)
    finally:
        ring.close()


def test_a_full_arena_refuses_and_the_encoder_falls_back_to_inline() -> None:
    ring = Arena(4096)
    try:
        assert ring.reserve(4097) is None
        first = ring.reserve(3000)
        assert ring.reserve(3000) is None  # 3000 + 3000 > 4096 while the first is in flight
        _take(ring, first, 3000)
        assert ring.reserve(3000) is not None
        encoder = Encoder(0, ring)
        packet = encoder.encode(np.zeros(3000, dtype=np.uint8))  # ring still holds one
        assert type(packet).__name__ == "_Inline"
        assert decode(_through_queue(packet)).shape == (3000,)
    finally:
        ring.close()


def _in_ring(ring: Arena, tensor: torch.Tensor) -> bool:
    start = np.frombuffer(ring._map, dtype=np.uint8).ctypes.data
    return start <= tensor.data_ptr() < start + len(ring._map)


def _handed_back(ring: Arena, number: int) -> bool:
    return bool(ring._slots()[number] == number)


def test_the_main_process_reads_arena_payloads_in_place_until_they_are_freed() -> None:
    ring = Arena(1 << 20)
    try:
        encoder = Encoder(0, ring)
        packets = [_through_queue(encoder.encode({"x": torch.full((1000,), i)})) for i in range(3)]
        items = [decode(packet) for packet in packets]
        del packets
        assert all(_in_ring(ring, item["x"]) for item in items)  # no copy was made
        assert [int(item["x"][0]) for item in items] == [0, 1, 2]
        assert ring.held_bytes > 0 and not any(_handed_back(ring, n) for n in (1, 2, 3))
        first, second, third = items
        del items, second
        gc.collect()
        # Space comes back in any order: a batch the user keeps holds only its own.
        assert [_handed_back(ring, n) for n in (1, 2, 3)] == [False, True, False]
        in_use = ring.reserve(4000)
        assert in_use is not None
        assert in_use[0] < int(third["x"].data_ptr()) - np.frombuffer(ring._map).ctypes.data
        view = third["x"][10:20]  # a view of a view keeps the space too
        del third
        gc.collect()
        assert not _handed_back(ring, 3) and int(view[0]) == 2
        del view, first
        gc.collect()
        assert _handed_back(ring, 1) and _handed_back(ring, 3) and ring.held_bytes == 0
    finally:
        ring.close()


def test_payloads_are_copied_once_half_the_ring_is_held_and_dropped_packets_hand_back() -> None:
    ring = Arena(1 << 16)
    try:
        encoder = Encoder(0, ring)
        kept = decode(_through_queue(encoder.encode(torch.ones(5000))))  # 20 KB of 64 KB
        copied = decode(_through_queue(encoder.encode(torch.zeros(5000))))  # would pass half
        assert _in_ring(ring, kept) and not _in_ring(ring, copied)
        assert not _handed_back(ring, 1) and _handed_back(ring, 2)
        dropped = _through_queue(encoder.encode(torch.zeros(10)))
        del dropped  # received but never decoded: its space comes back all the same
        assert _handed_back(ring, 3)
        del kept
        gc.collect()
        assert _handed_back(ring, 1)
        kept = decode(_through_queue(encoder.encode(torch.full((100,), 9.0))))
    finally:
        ring.close()
    # The ring is closed while a tensor still reads it: the memory stays mapped until it goes.
    assert float(kept.sum()) == 900.0
    del kept
    gc.collect()


def test_closed_arena_is_a_clear_error_not_a_crash() -> None:
    ring = Arena(1 << 16)
    packet = _through_queue(Encoder(0, ring).encode(torch.ones(100)))
    ring.close()
    ring.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"arena \d+, which is closed"):
        decode(packet)


def test_transport_arguments_are_validated() -> None:
    validate_transport_settings(True, DEFAULT_INLINE_BYTES, 0)
    with pytest.raises(TypeError, match="`transport_codec` must be True or False"):
        el.SavableDataLoader(reference_pipeline(8), num_workers=1, transport_codec="yes")
    with pytest.raises(ValueError, match="`transport_inline_bytes` must be >= 0"):
        el.SavableDataLoader(reference_pipeline(8), num_workers=1, transport_inline_bytes=-1)
    with pytest.raises(TypeError, match="`transport_arena_bytes` must be an integer"):
        el.SavableDataLoader(reference_pipeline(8), num_workers=1, transport_arena_bytes=1.5)
    with pytest.raises(ValueError, match=r"`transport_arena_bytes` must be 0 \(no shared memory"):
        el.SavableDataLoader(reference_pipeline(8), num_workers=1, transport_arena_bytes=10)


# -- through the loader ------------------------------------------------------------------


@attrs.frozen
class Images:
    """Sample ``i``: an image-like uint8 tensor, a bfloat16 view and a non-contiguous array."""

    def __call__(self, index: int) -> dict[str, Any]:
        image = (torch.arange(3 * 32 * 32) + index).to(torch.uint8).reshape(3, 32, 32)
        return {
            "index": index,
            "image": image,
            "half": image[0].to(torch.bfloat16).t(),
            "array": np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2] + index,
        }


@attrs.frozen
class SlowImages:
    """:class:`Images`, 20 ms each, so that a worker is busy when it is killed."""

    def __call__(self, index: int) -> dict[str, Any]:
        time.sleep(0.02)
        return Images()(index)


def tensor_sample(index: int) -> torch.Tensor:
    return torch.tensor([index, -index])


def image_pipeline(length: int = 48) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(length, Images(), shuffle=True, seed=3)
    return el.BatchDataset(el.ShuffleBufferDataset(source, size=8), batch_size=4)


def _arenas(process: int | str = "self") -> set[str]:
    """Names of the arenas a process holds open, as file descriptors or mappings."""
    found = set()
    for link in Path(f"/proc/{process}/fd").iterdir():
        with contextlib.suppress(OSError):
            found.update(_ARENA_NAME.findall(os.readlink(link)))
    return found | set(_ARENA_NAME.findall(Path(f"/proc/{process}/maps").read_text()))


_ARENA_NAME = re.compile(r"energy_loader-arena-\d+-\d+")


@pytest.mark.timeout(120)
# Slow: test_resume_properties_hold_with_every_transport draws 1-3 workers for every
# transport in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("codec", [True, False], ids=["codec", "torch"])
def test_resume_is_exact_with_the_codec_on_and_off(workers: int, codec: bool) -> None:
    spec = PipelineSpec(
        length=40,
        shuffle=True,
        seed=5,
        stages=(("map", None), ("shuffle_buffer", 5), ("batch", (3, False))),
    )
    check_resume(
        spec.build, num_workers=workers, epochs=2, loader_kwargs={"transport_codec": codec}
    )


TRANSPORTS = {
    "torch": {"transport_codec": False},
    "codec-inline": {"transport_inline_bytes": 1 << 40},
    "codec-arena": ARENA_ONLY,
}


@pytest.mark.timeout(240)
@settings(max_examples=8)
@given(
    spec=pipelines(max_length=30),
    workers=st.integers(1, 3),
    transport=st.sampled_from(sorted(TRANSPORTS)),
    data=st.data(),
)
def test_resume_properties_hold_with_every_transport(
    spec: PipelineSpec, workers: int, transport: str, data: st.DataObject
) -> None:
    # tests/test_resume_properties.py runs the whole property suite with the default codec
    # settings; this runs its core property with torch's transport and with each codec path.
    kwargs = TRANSPORTS[transport]
    loader = el.SavableDataLoader(spec.build(), num_workers=workers, **kwargs)
    total = len(record_events(loader, 2)[0])
    del loader
    stop = data.draw(st.integers(0, total), label="stop")
    check_resume(
        spec.build, num_workers=workers, epochs=2, stop_points=[stop], loader_kwargs=kwargs
    )


def torch_transport_reference(workers: int = 2) -> list[Any]:
    """The batches of :func:`image_pipeline` through torch's own transport."""
    return list(el.SavableDataLoader(image_pipeline(), num_workers=workers, transport_codec=False))


@pytest.mark.timeout(60)
def test_large_batches_arrive_equal_through_the_arena() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no read-only buffer warnings
        got = list(el.SavableDataLoader(image_pipeline(), num_workers=2, **ARENA_ONLY))
    difference = first_difference(torch_transport_reference(), got)
    assert difference is None, difference
    assert all(b["image"].is_contiguous() and b["half"].dtype == torch.bfloat16 for b in got)


@pytest.mark.timeout(120)
def test_shared_memory_path_resumes_exactly_under_fork() -> None:
    check_resume(image_pipeline, num_workers=2, stop_points=[0, 5, 12], loader_kwargs=ARENA_ONLY)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("method", "workers"),
    # A spawned worker is a fresh interpreter (~4 s of imports on 2 cores, twice: the restore
    # restarts it): the slow step's. Forkserver's two (the same pickled start) run by default.
    [
        pytest.param("spawn", 1, marks=pytest.mark.slow),
        pytest.param("spawn", 2, marks=pytest.mark.slow),
        ("forkserver", 2),
    ],
)
def test_arenas_reach_spawned_workers_and_are_recreated_on_restore(
    method: str, workers: int
) -> None:
    # The arenas' file descriptors travel to the workers with the dataset: at the first
    # start, and again after the restore restarts them.
    loader = el.SavableDataLoader(
        image_pipeline(), num_workers=workers, multiprocessing_context=method, **ARENA_ONLY
    )
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]
    loader.restore_state_rank(loader.save_state_rank())
    got = head + list(loader)
    difference = first_difference(torch_transport_reference(workers), got)
    assert difference is None, difference
    loader.reset_state()


@pytest.mark.timeout(60)
def test_break_and_restore_recreate_the_arenas_and_release_the_old_ones() -> None:
    before = _arenas()
    reference = [indices(b) for b in torch_transport_reference()]
    loader = el.SavableDataLoader(image_pipeline(), num_workers=2, **ARENA_ONLY)
    got = []
    for batch in loader:
        got.append(indices(batch))
        if len(got) == 3:
            break
    first = _arenas() - before
    assert len(first) == 2  # one per worker
    del batch  # read in place: a batch the user holds keeps its arena mapped
    state = loader.save_state_rank()
    got += [indices(b) for b in loader]  # the workers go on after the break, same arenas
    assert got == reference
    assert _arenas() - before == first
    loader.restore_state_rank(state)  # stops the workers: their arenas are released
    assert _arenas() - before == set()
    assert [indices(b) for b in loader] == reference[3:]
    loader.reset_state()
    assert _arenas() - before == set()


@pytest.mark.timeout(60)
def test_a_forked_worker_maps_only_its_own_arena() -> None:
    first = el.SavableDataLoader(image_pipeline(), num_workers=2, **ARENA_ONLY)
    next(iter(first))
    second = el.SavableDataLoader(image_pipeline(), num_workers=2, **ARENA_ONLY)
    iterator = iter(second)  # its workers were forked while the first loader's arenas were open
    (
        next(iterator),
        next(iterator),
    )  # one item from each worker: both have dropped what they inherited
    try:
        for worker in second._iterator._workers:
            deadline = time.monotonic() + 10
            while len(_arenas(worker.pid)) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(_arenas(worker.pid)) == 1, _arenas(worker.pid)
    finally:
        first.reset_state()
        second.reset_state()


@pytest.mark.timeout(60)
def test_a_killed_worker_leaves_no_shared_memory_behind() -> None:
    shm_before, arenas_before = set(os.listdir("/dev/shm")), _arenas()
    source = el.IndexedSource.from_fn(10_000, SlowImages())
    loader = el.SavableDataLoader(el.BatchDataset(source, 2), num_workers=2, **ARENA_ONLY)
    iterator = iter(loader)
    next(iterator)
    assert len(_arenas() - arenas_before) == 2
    pids = [os.getpid()] + [worker.pid for worker in loader._iterator._workers]
    os.kill(pids[2], signal.SIGKILL)
    with pytest.raises(el.WorkerError):
        for _ in range(10_000):
            next(iterator)
    loader.reset_state()
    assert _arenas() - arenas_before == set()
    # Shared memory files are named after the process that made them (torch's
    # ``torch_PID_...``); the tests running beside this one (pytest-xdist) make their own.
    left = set(os.listdir("/dev/shm")) - shm_before
    assert not {name for name in left if any(f"_{pid}_" in name for pid in pids)}, left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_basic_loader_uses_the_same_transport(workers: int) -> None:
    def two_epochs(loader: Any) -> list[Any]:
        return [batch for _ in range(2) for batch in loader]  # persistent workers and arenas

    reference = two_epochs(
        el.SavableDataLoader(image_pipeline(), num_workers=workers, transport_codec=False)
    )
    got = two_epochs(el.BasicDataLoader(image_pipeline(), num_workers=workers, **ARENA_ONLY))
    assert first_difference(reference, got) is None


@pytest.mark.timeout(60)
def test_pin_memory_with_the_codec_warns_without_an_accelerator_and_delivers() -> None:
    reference = [indices(b) for b in torch_transport_reference()]
    with pytest.warns(UserWarning, match="pin_memory"):
        loader = el.SavableDataLoader(
            image_pipeline(), num_workers=2, pin_memory=True, **ARENA_ONLY
        )
        assert [indices(b) for b in loader] == reference


@pytest.mark.timeout(60)
def test_tensor_samples_keep_their_restore_key_attribute_through_the_codec() -> None:
    in_process = list(el.SavableDataLoader(el.IndexedSource.from_fn(6, tensor_sample)))
    got = list(el.SavableDataLoader(el.IndexedSource.from_fn(6, tensor_sample), num_workers=2))
    assert [el.restore_key_of(t) for t in got] == [el.restore_key_of(t) for t in in_process]
    assert all(el.restore_key_of(t) is not None for t in got)


# -- collating into the arena ------------------------------------------------------------


@pytest.fixture
def collating() -> Any:
    """``collating(ring, min_bytes)``: this process collates into ``ring``, as a worker does."""

    def start(ring: Arena, min_bytes: int = 0) -> None:
        collate_into(ring, min_bytes)

    yield start
    collate_into(None, 0)


def _offset(ring: Arena, tensor: torch.Tensor) -> int:
    return tensor.data_ptr() - (np.frombuffer(ring._map, dtype=np.uint8).ctypes.data + 4096)


def _next_free_offset(ring: Arena, size: int = 64) -> int:
    """Where the ring would place a new region now (and give it back at once)."""
    gc.collect()
    probe = ring.reserve_tensor((size,), torch.uint8)
    assert probe is not None
    offset = _offset(ring, probe)
    del probe
    gc.collect()
    return offset


def test_batch_tensor_is_ordinary_memory_outside_a_worker_and_checks_its_arguments() -> None:
    tensor = batch_tensor((2, 3), torch.int16)
    assert tensor.shape == (2, 3) and tensor.dtype == torch.int16 and tensor.is_contiguous()
    with pytest.raises(TypeError, match=r"`dtype` must be a torch\.dtype"):
        batch_tensor((2,), np.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative sizes"):
        batch_tensor((2, -1), torch.float32)


def test_a_collated_tensor_is_sent_by_reference_and_read_in_place(collating: Any) -> None:
    ring = Arena(1 << 20)
    try:
        collating(ring)
        batch = batch_tensor((4, 1000), torch.float32)
        assert _in_ring(ring, batch)
        torch.stack([torch.full((1000,), float(i)) for i in range(4)], out=batch)
        batch.__restore_key__ = ("batch", 1)
        item = {"x": batch, "flat": batch.view(-1), "row": batch[1], "again": batch}
        encoder = Encoder(1 << 40, ring)  # the payload itself inline: only references in the ring
        packet = _through_queue(encoder.encode(item))
        address, nbytes = batch.data_ptr(), batch.nbytes
        del item, batch
        decoded = decode(packet)
        del packet
        # No copy: the main process reads the very bytes the collate wrote.
        assert decoded["x"].data_ptr() == decoded["flat"].data_ptr() == address
        assert decoded["again"] is decoded["x"]  # one object, pickled once
        assert decoded["x"].__restore_key__ == ("batch", 1)
        assert not _in_ring(ring, decoded["row"])  # a slice travels as a copy
        assert torch.equal(decoded["row"], torch.ones(1000))
        assert [float(v) for v in decoded["x"][:, 0]] == [0.0, 1.0, 2.0, 3.0]
        assert ring.held_bytes == nbytes  # two tensors, one region: one view, one hand-back
        # (a) the worker's references are gone, but the main process still reads it in place.
        assert _next_free_offset(ring) >= nbytes
        decoded["x"] += 1
        assert float(decoded["flat"][-1]) == 4.0
        del decoded
        gc.collect()
        assert ring.held_bytes == 0 and _handed_back(ring, 1)
        assert _next_free_offset(ring) == 0
    finally:
        ring.close()


def test_a_sent_region_stays_reserved_while_the_worker_keeps_the_tensor(collating: Any) -> None:
    ring = Arena(1 << 20)
    try:
        collating(ring)
        kept = batch_tensor((5000,), torch.uint8).fill_(7)
        encoder = Encoder(1 << 40, ring)
        decoded = decode(_through_queue(encoder.encode(kept)))
        del decoded
        gc.collect()  # handed back by the main process, still referenced by the worker
        assert _handed_back(ring, 1) and _next_free_offset(ring) >= 5000
        # Sent once: a second item carrying it gets a copy, not a second reference.
        again = decode(_through_queue(encoder.encode(kept)))
        assert not _in_ring(ring, again) and torch.equal(again, kept)
        del kept
        assert _next_free_offset(ring) == 0
    finally:
        ring.close()


def test_an_unsent_reservation_is_freed_when_the_worker_drops_it(collating: Any) -> None:
    ring = Arena(1 << 20)
    try:
        collating(ring)
        # (b) a map replaced the batch, a filter dropped it: the region comes back.
        dropped = batch_tensor((3, 1000), torch.float64)
        assert _offset(ring, dropped) == 0
        view = dropped[1:]
        del dropped
        assert _next_free_offset(ring) > 0  # a view keeps it
        del view
        assert _next_free_offset(ring) == 0
        # Freed in another thread (a finalizer may run anywhere): still comes back.
        elsewhere = [batch_tensor((3, 1000), torch.float64)]
        thread = threading.Thread(target=elsewhere.clear)
        thread.start()
        thread.join()
        assert _next_free_offset(ring) == 0
    finally:
        ring.close()


def test_a_packet_with_references_dropped_undecoded_hands_them_all_back(collating: Any) -> None:
    ring = Arena(1 << 20)
    try:
        collating(ring)
        item = [batch_tensor((1000,), torch.int32).zero_() for _ in range(3)]
        packet = _through_queue(Encoder(0, ring).encode(item))  # the payload in the ring too
        del item
        assert _next_free_offset(ring) > 0
        del packet  # (c) a loader stopped with it in flight
        assert all(_handed_back(ring, n) for n in (1, 2, 3, 4))
        assert _next_free_offset(ring) == 0 and ring.held_bytes == 0
    finally:
        ring.close()


def test_pinned_decode_copies_references_out_and_hands_them_back_at_once(
    collating: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = Arena(1 << 20)
    try:
        collating(ring)
        batch = batch_tensor((2, 1000), torch.float32).fill_(3.0)
        packet = _through_queue(Encoder(1 << 40, ring).encode({"x": batch}))
        del batch
        # (d) Without an accelerator nothing can be pinned: the decode reads in place.
        decoded = decode(packet.pin_memory())["x"]
        assert _in_ring(ring, decoded) == (not torch.accelerator.is_available())
        del decoded
        gc.collect()
        # With one, the reference is copied into the pinned buffer and handed back at once
        # (stood in for here by ordinary memory, so that the path runs on any machine).
        monkeypatch.setattr(
            "energy_loader.transport._arena.pinned_buffer",
            lambda size: np.empty(size, dtype=np.uint8),
        )
        batch = batch_tensor((2, 1000), torch.float32).fill_(5.0)
        packet = _through_queue(Encoder(1 << 40, ring).encode({"x": batch}))
        del batch
        decoded = decode(packet.pin_memory())["x"]
        assert not _in_ring(ring, decoded) and float(decoded.sum()) == 10_000.0
        assert _handed_back(ring, 2) and ring.held_bytes == 0
        assert _next_free_offset(ring) == 0
    finally:
        ring.close()


def test_a_full_arena_gives_ordinary_memory_and_the_batch_still_arrives(collating: Any) -> None:
    ring = Arena(4096)
    try:
        collating(ring, 100)
        first = batch_tensor((3000,), torch.uint8).fill_(1)
        second = batch_tensor((3000,), torch.uint8).fill_(2)  # (e) no room: never waits
        assert _in_ring(ring, first) and not _in_ring(ring, second)
        decoded = decode(_through_queue(Encoder(1 << 40, ring).encode([first, second])))
        assert decoded[0].tolist() == [1] * 3000 and decoded[1].tolist() == [2] * 3000
        assert _handed_back(ring, 1)  # (more than half the ring: copied out at once)
        assert not _in_ring(ring, batch_tensor((10,), torch.uint8))  # below min_bytes
    finally:
        ring.close()


def test_references_are_copied_once_half_the_ring_is_held(collating: Any) -> None:
    ring = Arena(1 << 16)
    try:
        collating(ring)
        encoder = Encoder(1 << 40, ring)
        kept = decode(_through_queue(encoder.encode(batch_tensor((5000,), torch.float32))))
        batch = batch_tensor((5000,), torch.float32).fill_(2.0)  # 20 KB more would pass half
        copied = decode(_through_queue(encoder.encode(batch)))
        del batch
        # (f) the second is copied out and handed back at once.
        assert _in_ring(ring, kept) and not _in_ring(ring, copied)
        assert _handed_back(ring, 2) and not _handed_back(ring, 1)
        assert float(copied.sum()) == 10_000.0
        del kept
        gc.collect()
        assert _handed_back(ring, 1) and ring.held_bytes == 0
    finally:
        ring.close()


def test_payload_numbers_never_share_a_slot_with_one_in_use() -> None:
    ring = Arena(1 << 20)
    try:
        first = ring.reserve(64)  # payload 1, kept
        assert first is not None
        for _ in range(511):
            _take(ring, ring.reserve(64), 64)
        late = ring.reserve(64)  # number 513 would share slot 1 with the kept payload
        _take(ring, late, 64)
        _take(ring, first, 64)  # had they shared it, the late hand-back would be lost
        assert late is not None and late[1] % 512 != 1
        assert ring.reserve(1 << 20) is not None  # every region came back
    finally:
        ring.close()


REAL_DTYPES = [torch.bool, torch.uint8, torch.int64, torch.float16, torch.bfloat16, torch.float32]
SAMPLE_DTYPES = [*REAL_DTYPES, torch.complex64]


@st.composite
def sample_lists(draw: st.DrawFn) -> list[Any]:
    """Samples of one structure: tensors or arrays of one shape, various layouts and dtypes."""
    count = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    kind = draw(st.sampled_from(["tensor", "array", "mixed-dtypes", "grad", "dict"]))
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(SAMPLE_DTYPES))
    seeds = [draw(st.integers(0, 2**16)) for _ in range(count)]
    values = [_values(shape, seed) for seed in seeds]
    if kind == "array":
        numpy_dtype = draw(st.sampled_from(ARRAY_DTYPES))
        return [_relayout(v.astype(numpy_dtype), layout) for v in values]
    tensors = [_relayout(torch.from_numpy(v).to(dtype), layout) for v in values]
    if kind == "mixed-dtypes":
        return [torch.from_numpy(v).to(draw(st.sampled_from(REAL_DTYPES))) for v in values]
    if kind == "grad":
        return [torch.from_numpy(v).requires_grad_() for v in values]
    if kind == "dict":
        return [{"x": t, "n": i, "y": (t, float(i))} for i, t in enumerate(tensors)]
    return tensors


@settings(max_examples=150, deadline=None)
@given(samples=sample_lists())
def test_default_collate_gives_the_same_batches_when_collating_into_the_arena(
    samples: list[Any],
) -> None:
    ring = Arena(1 << 20)
    try:
        expected = el.default_collate(samples)
        collate_into(ring, 0)
        got = el.default_collate(samples)
        assert first_difference(expected, got) is None, first_difference(expected, got)
        _check_same_batch_kinds(expected, got)
        del got
    finally:
        collate_into(None, 0)
        ring.close()


def _check_same_batch_kinds(expected: Any, got: Any) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.requires_grad == expected.requires_grad
    elif isinstance(expected, dict):
        for key in expected:
            _check_same_batch_kinds(expected[key], got[key])
    elif isinstance(expected, (list, tuple)):
        for a, b in zip(expected, got):
            _check_same_batch_kinds(a, b)


@attrs.frozen
class BigImages:
    """Sample ``i``: a 12 KiB image, so that a batch of 4 (48 KiB) passes the inline threshold."""

    def __call__(self, index: int) -> dict[str, Any]:
        row = (torch.arange(64, dtype=torch.int32) + index).to(torch.uint8)
        return {"index": index, "image": row.expand(3, 64, 64).contiguous()}


def recollate(batch: dict[str, Any]) -> dict[str, Any]:
    """Replace the batch's image by a new one, collated again (the old one dies unsent)."""
    return {"index": batch["index"], "image": el.default_collate(list(batch["image"]))}


def even_batches(batch: dict[str, Any]) -> bool:
    return int(batch["index"][0]) % 2 == 0


def big_image_pipeline(length: int = 160, *, drop: bool = False) -> el.SavableDataset:
    source = el.IndexedSource.from_fn(length, BigImages(), shuffle=True, seed=1)
    batches: el.SavableDataset = el.BatchDataset(source, batch_size=4)
    if drop:
        batches = el.FilterDataset(el.MapDataset(batches, recollate), even_batches)
    return batches


def _main_arenas(loader: Any) -> list[Arena]:
    return list(loader.engine.transport._arenas)


def _in_some_ring(arenas: list[Arena], tensor: torch.Tensor) -> bool:
    return any(_in_ring(ring, tensor) for ring in arenas)


def _reference(pipeline: el.SavableDataset) -> list[Any]:
    return list(el.SavableDataLoader(pipeline, num_workers=2, transport_codec=False))


@pytest.mark.timeout(60)
def test_workers_collate_large_batches_into_the_arena_and_they_arrive_without_a_copy() -> None:
    reference = _reference(big_image_pipeline())
    loader = el.SavableDataLoader(big_image_pipeline(), num_workers=2)  # default settings
    got, in_place = [], []
    for batch in loader:
        # The payload (a small pickle stream) went inline: a tensor in the ring was written
        # there by the worker's collate and is read where it lies.
        in_place.append(_in_some_ring(_main_arenas(loader), batch["image"]))
        got.append(batch)
    assert all(in_place)
    assert first_difference(reference, got) is None
    kept = got[:3]  # (a) kept while the workers went on: never overwritten
    del got, batch
    assert first_difference(reference[:3], kept) is None
    arenas = _main_arenas(loader)
    assert sum(ring.held_bytes for ring in arenas) == 3 * 4 * 3 * 64 * 64
    del kept
    gc.collect()
    assert sum(ring.held_bytes for ring in arenas) == 0
    loader.reset_state()


@pytest.mark.timeout(60)
def test_batches_a_worker_replaces_or_drops_give_their_space_back() -> None:
    # (b) Each batch is collated, collated again by a map (the first dies unsent), and half
    # are filtered out. Each arena holds 8 batches: were any of those regions lost, the ring
    # would fill within a few batches and the rest would arrive as copies.
    reference = _reference(big_image_pipeline(drop=True))
    loader = el.SavableDataLoader(
        big_image_pipeline(drop=True), num_workers=2, transport_arena_bytes=8 * 49_152
    )
    in_place, got = [], []
    for batch in loader:
        in_place.append(_in_some_ring(_main_arenas(loader), batch["image"]))
        got.append(indices(batch))
        del batch
    assert got == [indices(b) for b in reference] and 10 <= len(got) <= 30
    assert all(in_place), in_place
    loader.reset_state()


@pytest.mark.timeout(60)
def test_a_user_keeping_every_batch_gets_copies_past_half_the_ring_and_no_stall() -> None:
    # (f) with the workers: half of each 8-batch arena is held, then the main process copies.
    reference = _reference(big_image_pipeline())
    loader = el.SavableDataLoader(
        big_image_pipeline(), num_workers=2, transport_arena_bytes=8 * 49_152
    )
    got = list(loader)
    in_place = [_in_some_ring(_main_arenas(loader), b["image"]) for b in got]
    assert any(in_place) and not all(in_place)
    assert first_difference(reference, got) is None
    loader.reset_state()


@pytest.mark.timeout(60)
def test_an_arena_too_small_for_a_batch_falls_back_to_ordinary_memory() -> None:
    # (e) 4 KiB arenas: no batch fits, every one is collated into ordinary memory.
    reference = _reference(big_image_pipeline())
    loader = el.SavableDataLoader(big_image_pipeline(), num_workers=2, transport_arena_bytes=4096)
    got = list(loader)
    assert not any(_in_some_ring(_main_arenas(loader), b["image"]) for b in got)
    assert first_difference(reference, got) is None
    loader.reset_state()


@pytest.mark.timeout(120)
def test_collated_batches_resume_exactly_and_survive_a_restore_while_held() -> None:
    check_resume(big_image_pipeline, num_workers=2, stop_points=[0, 7, 23])
    loader = el.SavableDataLoader(big_image_pipeline(), num_workers=2)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(3)]
    loader.restore_state_rank(loader.save_state_rank())  # (g) the arenas close under them
    assert first_difference(_reference(big_image_pipeline())[:3], held) is None
    rest = list(loader)
    assert len(held) + len(rest) == 40
    loader.reset_state()
