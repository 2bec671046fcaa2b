"""What the repository's benchmark scripts share, beside the package rather than in it.

The installed package's ``python -m energy_loader bench`` (:mod:`energy_loader.cli.bench`)
runs the reference workload against a plain torch DataLoader; this harness builds on its
workload and functions for the rest of docs/benchmarks.md:

- :mod:`.bench`: :class:`~.bench.Bench`, a bench program whose methods are seams, and
  :class:`~.bench.Contender`, a library's loader as every bench drives it;
- :mod:`.runner`: :class:`~.runner.WorkloadBench`, that bench with every workload, the CPU and
  peak RSS of each process and a figure (``benchmarks/bench_loader.py``; with the other
  libraries' loaders of ``benchmarks/peers/``, ``benchmarks/bench_peers.py``);
- :mod:`.workloads`: the ``large`` synthetic workload and the real ``llm`` and ``vision`` ones;
- :mod:`.data`, :mod:`.llm`, :mod:`.vision`: the real workloads' files and pipelines;
- :mod:`.processes`: what a run's processes cost, read from ``/proc``.

The scripts put the repository on ``sys.path`` and import it as ``benchmarks.harness``.
"""
