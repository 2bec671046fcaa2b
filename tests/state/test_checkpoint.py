"""Checkpoint files: atomic, checksummed, weights_only, newest-intact fallback."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import energy_loader as el
from energy_loader.state import CheckpointDirectory, load_checkpoint, save_checkpoint
from tests.helpers import reference_pipeline


def _loader_state() -> dict:
    loader = el.SavableDataLoader(reference_pipeline(300, 16, 4))
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    return loader.save_state_rank()


def test_round_trip_and_no_temporary_files_left(tmp_path) -> None:
    state = _loader_state()
    path = save_checkpoint(tmp_path / "loader.pt", {"step": 5, "loader": state})
    assert load_checkpoint(path) == {"step": 5, "loader": state}
    assert [p.name for p in tmp_path.iterdir()] == ["loader.pt"]


def test_directory_keeps_the_newest_and_falls_back_past_damaged_files(tmp_path, caplog) -> None:
    checkpoints = CheckpointDirectory(tmp_path, keep=3)
    for step in range(0, 50, 10):
        checkpoints.save({"step": step}, step=step)
    assert checkpoints.steps() == [20, 30, 40]
    newest = checkpoints.path_for(40)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    middle = checkpoints.path_for(30)
    data = bytearray(middle.read_bytes())
    data[data.index(b"step")] ^= 0x01  # one flipped bit inside the stored payload
    middle.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="energy_loader.checkpoint"):
        assert checkpoints.load_latest() == (20, {"step": 20})
    assert len(caplog.records) == 2 and "checkpoint-000000000040.pt" in caplog.records[0].message


def test_checksum_catches_a_payload_edited_after_writing(tmp_path) -> None:
    path = save_checkpoint(tmp_path / "a.pt", {"step": 1})
    record = torch.load(path, weights_only=True)
    record["payload"]["step"] = 2
    torch.save(record, path)
    with pytest.raises(el.StateFormatError, match="checksum mismatch"):
        load_checkpoint(path)


class _Exploit:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_pickled_payload_that_would_run_code_is_refused(tmp_path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with open(path, "wb") as stream:
        pickle.dump(
            {"format": "energy_loader.checkpoint", "payload": _Exploit(str(marker))}, stream
        )
    torch.save(
        {"format": "energy_loader.checkpoint", "x": _Exploit(str(marker))}, tmp_path / "evil2.pt"
    )
    for candidate in (path, tmp_path / "evil2.pt"):
        with pytest.raises(el.StateFormatError, match="not a readable checkpoint"):
            load_checkpoint(candidate)
    assert not marker.exists()
    loader = el.SavableDataLoader(reference_pipeline(100, 4, 4))
    with pytest.raises(el.StateFormatError):
        loader.restore_state_rank(
            {"format": "energy_loader.rank_state", "x": _Exploit(str(marker))}
        )
    assert not marker.exists()


def test_non_plain_payloads_are_refused_before_writing(tmp_path) -> None:
    with pytest.raises(el.StateFormatError, match=r"payload\.t is a Tensor"):
        save_checkpoint(tmp_path / "x.pt", {"t": torch.zeros(1)})
    with pytest.raises(TypeError, match="`payload` must be a dict"):
        save_checkpoint(tmp_path / "x.pt", [1, 2])
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path) -> None:
    # A real write failure: the child process may not write files larger than 4 KiB
    # (RLIMIT_FSIZE, the kernel's answer is EFBIG, like a full disk mid-write).
    good = {"step": 1, "blob": "x" * 10}
    save_checkpoint(tmp_path / "loader.pt", good)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        from energy_loader.state import save_checkpoint
        try:
            save_checkpoint({str(tmp_path / "loader.pt")!r}, {{"step": 2, "blob": "y" * 100000}})
        except OSError as error:
            print("failed:", error.errno)
            sys.exit(0)
        sys.exit(1)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "failed: 27" in result.stdout  # EFBIG
    assert load_checkpoint(tmp_path / "loader.pt") == good
    assert [p.name for p in tmp_path.iterdir()] == ["loader.pt"]


def test_arguments_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="`keep` must be a positive integer"):
        CheckpointDirectory(tmp_path, keep=0)
    with pytest.raises(ValueError, match="`step` must be a non-negative integer"):
        CheckpointDirectory(tmp_path).save({}, step=-1)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")
    json.dumps(_loader_state())
    os.sync()
