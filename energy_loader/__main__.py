"""Command line: ``python -m energy_loader {demo,inspect,bench,index,replay} ...``."""

from __future__ import annotations

import sys

_USAGE = """usage: python -m energy_loader COMMAND [options]

commands:
  demo      kill a training run at a random step, resume it, compare with an uninterrupted run
  inspect   pretty-print a saved loader state or checkpoint file
  bench     run the reference benchmark against a plain torch DataLoader
  index     build the member index of WebDataset tar shards (for random access)
  replay    print the restore keys (or samples) of any steps of a saved job

python -m energy_loader COMMAND --help describes each command's options."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from .cli.demo import main as run
    elif command == "inspect":
        from .cli.inspect import main as run
    elif command == "bench":
        from .cli.bench import main as run
    elif command == "index":
        from .cli.index import main as run
    elif command == "replay":
        from .cli.replay import main as run
    else:
        print(f"unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
