"""The main-process side of the loader.

- :mod:`~energy_loader.loader.savable_loader`: :class:`SavableDataLoader` (torch's
  ``DataLoader`` subclass users hold), which picks one engine, and :class:`BasicDataLoader`;
- :mod:`~energy_loader.loader.engine`: the protocol every engine implements, and the one
  restore path (decode, check, plan, apply);
- :mod:`~energy_loader.loader.pipeline_engine`: savable pipelines (partitions, progress,
  positions), with :mod:`~energy_loader.loader.pipeline_states` (their states out of leaves
  and rank files);
- :mod:`~energy_loader.loader.dropin`: the map-style and iterable engines (torch's behaviour,
  exact resume);
- :mod:`~energy_loader.loader.torch_args`: torch's batching arguments given with a pipeline;
- :mod:`~energy_loader.loader.fleet`: the worker processes seen from here: channels, books,
  requests and replies, shutdown, error attribution;
- :mod:`~energy_loader.loader.planner`: save and restore planning, pure (no process, no I/O);
- :mod:`~energy_loader.loader.partitions`: logical partitions and who runs which;
- :mod:`~energy_loader.loader.progress`: what the main process knows of the epoch;
- :mod:`~energy_loader.loader.unbundler`: bundled items handed out one at a time, in order;
- :mod:`~energy_loader.loader.peek`: what a rank yields next, from a state, without workers;
- :mod:`~energy_loader.loader.arguments`: constructor argument checks;
- :mod:`~energy_loader.loader.stall`: the stall warning.

The worker-process side is :mod:`energy_loader.workers`; it never imports this package.
"""

from .savable_loader import BasicDataLoader, SavableDataLoader

__all__ = ["BasicDataLoader", "SavableDataLoader"]
