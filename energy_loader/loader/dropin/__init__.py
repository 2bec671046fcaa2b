"""The drop-in engines: torch's DataLoader behaviour for plain datasets, with exact resume.

``SavableDataLoader(dataset, ...)`` with a dataset that is not a savable pipeline runs it on
one of these engines (:mod:`energy_loader.loader.engine`). Modules: ``build`` (which engine,
the checks of its options, and :func:`~.build.runs_dropin`), ``map_style`` and ``iterable``
(how each kind of dataset runs), ``restore`` (the save and restore half of the engine protocol
for both), ``stream`` and ``position`` (the recorded index stream and where it stands),
``sampling`` (the generators that drive a sampler), ``global_rngs`` (the account of the
training process's global generators), ``pin`` (a start pinned by a save before the first
``iter()``), ``job`` (one job seed and id per job), ``state`` and ``entries`` (the saved
format), ``values`` (the proof of values), ``trainers`` (Lightning's count of a resumed
epoch).

This package's ``__init__`` imports nothing: import the module you need.
"""
