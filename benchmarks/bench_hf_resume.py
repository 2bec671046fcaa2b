"""Resuming Hugging Face training mid-epoch: rows lost, rows repeated, augmentations redrawn,
and the time to the first resumed step, for the tools Hugging Face users have and for ours.

Data: a ``datasets.Dataset`` of ``--rows`` rows whose ``set_transform`` draws a random number
per row (the augmentation), and the same rows as a ``to_iterable_dataset(num_shards=4)``
stream whose ``.map`` draws it (split by ``split_dataset_by_node`` on several processes).
A one-weight model, batches of 4, 2 workers per process, 2 epochs. Contenders:

- ``trainer``: ``transformers.Trainer(train_dataset=...)`` and its own resume
  (``train(resume_from_checkpoint=...)``: it replays the batches trained, ``skip_first_batches``);
- ``stateful``: an Accelerate loop with ``DataLoaderConfiguration(use_stateful_dataloader=True)``
  (torchdata's ``StatefulDataLoader``), ``save_state``/``load_state``;
- ``skip``: an Accelerate loop that saves its step with ``save_state`` and calls
  ``accelerator.skip_first_batches`` in the resumed epoch;
- ``ours-trainer``: ``SavableLoaderTrainer`` over a drop-in ``SavableDataLoader`` (under a
  ``DistributedSampler`` on several processes);
- ``ours-accelerate``: the Accelerate loop with ``prepare_loader`` over the same drop-in.

Each contender runs uninterrupted (its own reference), then again, saving after step
``--save-at`` of each process and stopping; fresh processes resume from that checkpoint and
train to the end. Per epoch (every ``rows / processes`` rows a process trains), the rows of all
processes are compared with the reference's: *lost* (in the reference, not in the resumed
run), *repeated* (the other way round), *augmented differently* (a row in both whose random
number differs). *First step* is the time from the start of the resume (``load_state``, or
Trainer's ``train()``) to the first batch in the training step, beside the same for the
uninterrupted run (from the start of its loop or ``train()``). Run::

    python benchmarks/bench_hf_resume.py [--rows 96] [--save-at 5] [--processes 1 2]
        [--contenders trainer stateful skip ours-trainer ours-accelerate] [--data map stream]

Needs the ``integrations`` extra and torchdata 0.11 (the ``bench`` extra) for ``stateful``.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

BATCH, WORKERS, EPOCHS, SEED = 4, 2, 2, 17
CONTENDERS = ["trainer", "stateful", "skip", "ours-trainer", "ours-accelerate"]


# -- data and model (built inside the rank processes) -------------------------------------------


def _augment(batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {"index": torch.tensor(batch["index"]), "noise": torch.rand(len(batch["index"]))}


def _augment_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"index": row["index"], "noise": random.random()}


def _data(kind: str, rows: int, rank: int, world: int) -> Any:
    import datasets

    table = datasets.Dataset.from_dict({"index": list(range(rows))})
    if kind == "map":
        table.set_transform(_augment)
        return table
    stream = table.to_iterable_dataset(num_shards=4).map(_augment_row)
    if world > 1:
        from datasets.distributed import split_dataset_by_node

        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return stream


def _model() -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def forward(self, index: Any, noise: Any) -> dict[str, Any]:
            return {"loss": (self.linear(noise.float().unsqueeze(1)) - 1).pow(2).mean()}

    torch.manual_seed(0)
    return Tiny()


def _savable(kind: str, data: Any, world: int) -> Any:
    import energy_loader as el

    if kind == "stream":
        return el.SavableDataLoader(data, batch_size=BATCH, num_workers=WORKERS)
    if world > 1:
        from torch.utils.data import DistributedSampler

        sampler = DistributedSampler(data, seed=SEED)
        return el.SavableDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return el.SavableDataLoader(
        data, batch_size=BATCH, shuffle=True, generator=generator, num_workers=WORKERS
    )


# -- the Trainer contenders ----------------------------------------------------------------------


def _trainer_run(contender: str, kind: str, rows: int, out: Path, phase: str, save_at: int) -> Any:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from energy_loader.integrations.transformers import SavableLoaderTrainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen: list[tuple[int, float]] = []
    first: list[float] = []

    class Stop(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if phase == "head" and state.global_step == save_at:
                control.should_training_stop = True
            return control

    def record(self: Any, model: Any, inputs: dict[str, Any], *args: Any) -> Any:
        if not first:
            first.append(time.perf_counter())
        for index, noise in zip(inputs["index"].tolist(), inputs["noise"].tolist()):
            seen.append((int(index), float(noise)))
        return base.training_step(self, model, inputs, *args)

    steps = EPOCHS * rows // (BATCH * world)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=save_at if phase == "head" else steps + 1,
        per_device_train_batch_size=BATCH,
        dataloader_num_workers=WORKERS,
        remove_unused_columns=False,
        learning_rate=0.1,
        use_cpu=True,
        report_to=[],
        logging_steps=10_000,
        disable_tqdm=True,
        seed=SEED,
        data_seed=SEED,
    )
    data = _data(kind, rows, rank, world)
    base: Any = Trainer if contender == "trainer" else SavableLoaderTrainer
    cls = type("Recording", (base,), {"training_step": record})
    if contender == "trainer":
        trainer = cls(model=_model(), args=args, train_dataset=data, callbacks=[Stop()])
    else:
        trainer = cls(
            model=_model(), args=args, train_loader=_savable(kind, data, world), callbacks=[Stop()]
        )
    began = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if phase == "tail" else None)
    if contender != "trainer":
        trainer.train_loader.close()
    del torch
    return seen, (first[0] - began) if first else None


# -- the Accelerate contenders -------------------------------------------------------------------


class _Progress:
    def __init__(self) -> None:
        self.epoch, self.step, self.in_epoch = 0, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "in_epoch": self.in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step, self.in_epoch = state["epoch"], state["step"], state["in_epoch"]


def _accelerate_run(
    contender: str, kind: str, rows: int, out: Path, phase: str, save_at: int
) -> Any:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from energy_loader.integrations.accelerate import prepare_loader

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = DataLoaderConfiguration(use_stateful_dataloader=contender == "stateful")
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(SEED)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = _data(kind, rows, rank, world)
    savable = None
    if contender == "ours-accelerate":
        savable = _savable(kind, data, world)
        loader: Any = prepare_loader(accelerator, savable)
    else:
        shuffle = kind == "map"
        loader = accelerator.prepare(
            DataLoader(data, batch_size=BATCH, shuffle=shuffle, num_workers=WORKERS)
        )
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    seen: list[tuple[int, float]] = []
    first: list[float] = []
    began = time.perf_counter()
    if phase == "tail":
        accelerator.load_state(str(out))
    sampler = getattr(savable, "sampler", None)
    while progress.epoch < EPOCHS:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(progress.epoch)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(progress.epoch)
        epoch_loader = loader
        if contender == "skip" and phase == "tail" and progress.in_epoch and not seen:
            epoch_loader = accelerator.skip_first_batches(loader, progress.in_epoch)
        for batch in epoch_loader:
            if not first:
                first.append(time.perf_counter())
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            for index, noise in zip(batch["index"].tolist(), batch["noise"].tolist()):
                seen.append((int(index), float(noise)))
            progress.step += 1
            progress.in_epoch += 1
            if phase == "head" and progress.step == save_at:
                accelerator.save_state(str(out))
                if savable is not None:
                    savable.close()
                return seen, first[0] - began
        progress.epoch += 1
        progress.in_epoch = 0
    if savable is not None:
        savable.close()
    return seen, (first[0] - began) if first else None


# -- processes -----------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, jobs: list[dict[str, Any]], out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    results = []
    for job in jobs:
        run = _trainer_run if "trainer" in job["contender"] else _accelerate_run
        folder = Path(out) / f"{job['contender']}-{job['data']}-{job['tag']}"
        seen, first = run(
            job["contender"], job["data"], job["rows"], folder, job["phase"], job["save_at"]
        )
        results.append({**job, "seen": seen, "first_step_s": first})
    Path(out, f"result_{rank}.json").write_text(json.dumps(results))


def _launch(world: int, jobs: list[dict[str, Any]], out: Path, timeout: float) -> list[Any]:
    """Run ``jobs`` one after the other on ``world`` fresh processes; every rank's results."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, jobs, str(out)))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(1.0, deadline - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    if hung or any(p.exitcode for p in processes):
        raise RuntimeError(f"rank processes failed or hung: {[p.exitcode for p in processes]}")
    return [json.loads((out / f"result_{rank}.json").read_text()) for rank in range(world)]


def _epochs(seen: list[list[Any]], per_rank: int) -> list[dict[int, list[float]]]:
    """Per epoch (each ``per_rank`` rows of every rank), the noises each row was trained with."""
    epochs: list[dict[int, list[float]]] = [collections.defaultdict(list) for _ in range(EPOCHS)]
    for rows in seen:
        for position, (index, noise) in enumerate(rows):
            if position // per_rank < EPOCHS:
                epochs[position // per_rank][index].append(noise)
    return epochs


def _compare(reference: list[Any], resumed: list[Any], per_rank: int) -> dict[str, int]:
    lost = repeated = augmented = 0
    for want, got in zip(_epochs(reference, per_rank), _epochs(resumed, per_rank), strict=True):
        for index in set(want) | set(got):
            expected, actual = want.get(index, []), got.get(index, [])
            lost += max(0, len(expected) - len(actual))
            repeated += max(0, len(actual) - len(expected))
            if expected and actual and expected[0] != actual[0]:
                augmented += 1
    return {"lost": lost, "repeated": repeated, "augmented_differently": augmented}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96, help="rows in the dataset (96)")
    parser.add_argument(
        "--save-at", type=int, default=5, help="the step after which each process saves (5)"
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--data", nargs="+", default=["map", "stream"], choices=["map", "stream"])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="also write the table's rows as JSON here")
    options = parser.parse_args(argv)
    if options.rows % (BATCH * max(options.processes) * 4):
        parser.error(f"--rows must be a multiple of {BATCH * max(options.processes) * 4}")
    table = []
    for world in options.processes:
        per_rank = options.rows // world
        if options.save_at * BATCH >= per_rank * EPOCHS:
            parser.error("--save-at must fall before the last step")
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder)
            base = {"rows": options.rows, "save_at": options.save_at}
            jobs = [
                {**base, "contender": c, "data": d, "tag": tag, "phase": phase}
                for c in options.contenders
                for d in options.data
                for tag, phase in (("reference", "full"), ("run", "head"))
            ]
            first = _launch(world, jobs, out, options.timeout)
            tails = [{**job, "tag": "run", "phase": "tail"} for job in jobs if job["tag"] == "run"]
            second = _launch(world, tails, out, options.timeout)
        for index, tail in enumerate(tails):
            key = (tail["contender"], tail["data"])
            reference = [r for ranks in first for r in ranks if (r["contender"], r["data"]) == key]
            full = [r["seen"] for r in reference if r["tag"] == "reference"]
            resumed = [
                head["seen"] + ranks[index]["seen"]
                for head, ranks in zip(
                    [r for r in reference if r["tag"] == "run"], second, strict=True
                )
            ]
            waits = [ranks[index]["first_step_s"] for ranks in second]
            fresh = [r["first_step_s"] for r in reference if r["tag"] == "reference"]
            row = {
                "processes": world,
                "contender": tail["contender"],
                "data": tail["data"],
                **_compare(full, resumed, per_rank),
                "first_step_s": max(w for w in waits if w is not None) if any(waits) else None,
                "fresh_first_step_s": max(f for f in fresh if f is not None)
                if any(fresh)
                else None,
            }
            table.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| processes | contender | data | rows lost | rows repeated | augmented differently "
          "| first resumed step (s) | a fresh run's (s) |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in table:
        wait, fresh = (
            "-" if row[key] is None else f"{row[key]:.2f}"
            for key in ("first_step_s", "fresh_first_step_s")
        )
        print(
            f"| {row['processes']} | {row['contender']} | {row['data']} | {row['lost']} | "
            f"{row['repeated']} | {row['augmented_differently']} | {wait} | {fresh} |"
        )
    if options.json is not None:
        options.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
