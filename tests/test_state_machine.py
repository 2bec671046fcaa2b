"""A stateful hypothesis test: next / save / restore / new-iter against a list model.

The model is the uninterrupted run as a list of events (samples and epoch ends). The machine
drives a real loader with any interleaving of: take the next sample, break and call iter()
again, save the state (kept), and restore one of the kept states into a fresh loader. After
every step the loader must be exactly where the model says. An epoch whose samples have all
been taken is over: a new iterator goes on with the next epoch without reporting its end.
"""

from __future__ import annotations

import json

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import energy_loader as el
from energy_loader.testing import END, record_events
from energy_loader.testing.compare import first_difference
from energy_loader.testing.strategies import PipelineSpec

PIPELINE = PipelineSpec(
    length=23,
    shuffle=True,
    seed=5,
    stages=(("map", None), ("filter", 4), ("shuffle_buffer", 6), ("batch", (3, False))),
)
EPOCHS = 3


class LoaderMachine(RuleBasedStateMachine):
    workers = 0

    def _loader(self) -> el.SavableDataLoader:
        return el.SavableDataLoader(PIPELINE.build(), num_workers=self.workers)

    @initialize()
    def start(self) -> None:
        self.events, _ = record_events(self._loader(), EPOCHS)
        self.loader = self._loader()
        self.iterator = None
        self.position = 0  # events consumed
        self.saved: list[tuple[int, dict]] = []

    def _expect(self, got) -> None:
        want = self.events[self.position]
        if want is END:
            assert got is END, f"expected the end of an epoch at event {self.position}"
        else:
            assert got is not END, f"expected a sample at event {self.position}, the epoch ended"
            assert first_difference(want, got) is None, first_difference(want, got)
        self.position += 1

    @precondition(lambda self: self.position < len(self.events))
    @rule()
    def take_next(self) -> None:
        if self.iterator is None:
            if self.events[self.position] is END:
                # Every item of the epoch was taken: the epoch is over and a new iter() starts
                # the next one without reporting this end.
                self.position += 1
                if self.position == len(self.events):
                    return
            self.iterator = iter(self.loader)
        try:
            got = next(self.iterator)
        except StopIteration:
            got = END
            self.iterator = None
        self._expect(got)

    @rule()
    def break_and_iter_again(self) -> None:
        self.iterator = None

    @rule()
    def save(self) -> None:
        state = json.loads(json.dumps(self.loader.save_state_rank()))
        self.saved.append((self.position, state))

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        position, state = data.draw(st.sampled_from(self.saved))
        self.loader = self._loader()
        self.loader.restore_state_rank(state)
        self.iterator = None
        self.position = position

    @invariant()
    def position_in_range(self) -> None:
        assert 0 <= self.position <= len(self.events)


class WorkerLoaderMachine(LoaderMachine):
    """The same with two worker processes (restores restart and rotate them)."""

    workers = 2


LoaderMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
WorkerLoaderMachine.TestCase.settings = settings(
    max_examples=4, stateful_step_count=15, deadline=None
)
TestLoaderMachine = LoaderMachine.TestCase
TestWorkerLoaderMachine = WorkerLoaderMachine.TestCase
