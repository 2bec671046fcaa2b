"""A training-like loop for the torture test: ``python -m tests.reliability.torture_trainer``.

It resumes from the newest intact checkpoint in ``--dir`` (if any), logs every step's sample
indices and a checksum of the batch (fsync'ed before each checkpoint), saves the loader state
every ``--save-every`` steps with a CheckpointDirectory, and dies by SIGKILL of its whole
process group (itself and its loader workers) where the kill plan says: at a step, or a random
0-3 ms after it opens the temporary file of its n-th checkpoint write.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading

import energy_loader as el
from energy_loader.state import CheckpointDirectory
from tests.helpers import reference_pipeline


def _kill_everything() -> None:
    os.killpg(0, signal.SIGKILL)


def _arm_write_kill(nth_save: int, seed: int) -> None:
    """SIGKILL a random moment after the n-th checkpoint temp file is created."""
    seen = [0]
    delay = random.Random(seed).uniform(0, 0.003)

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], str):
            return
        name = os.path.basename(args[0])
        if name.startswith(".checkpoint-") and name.endswith(".tmp"):
            seen[0] += 1
            if seen[0] == nth_save:
                threading.Timer(delay, _kill_everything).start()

    sys.addaudithook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-save", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loader = el.SavableDataLoader(reference_pipeline(args.samples, 50, 8), num_workers=2)
    checkpoints = CheckpointDirectory(args.dir, keep=3)
    step, epoch, resumed_from = 0, 0, -1
    found = checkpoints.load_latest()
    if found is not None:
        payload = found[1]
        loader.load_state_dict(payload["loader"])
        step, epoch, resumed_from = payload["step"] + 1, payload["epoch"], payload["step"]
    if args.kill_save:
        _arm_write_kill(args.kill_save, args.seed)
    with open(args.log, "a") as log:
        log.write(json.dumps({"resumed_from": resumed_from, "pid": os.getpid()}) + "\n")
        while epoch < args.epochs:
            for batch in loader:
                noise = round(float(sum(batch["noise"].tolist())), 12)
                record = {"step": step, "indices": batch["index"].tolist(), "noise": noise}
                log.write(json.dumps(record) + "\n")
                if step == args.kill_step:
                    log.flush()
                    _kill_everything()
                if step % args.save_every == 0:
                    log.flush()
                    os.fsync(log.fileno())
                    state = loader.state_dict()
                    checkpoints.save({"step": step, "epoch": epoch, "loader": state}, step=step)
                step += 1
            epoch += 1
        log.write(json.dumps({"finished": step}) + "\n")


if __name__ == "__main__":
    main()
