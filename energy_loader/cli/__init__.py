"""The command-line tools: ``python -m energy_loader {demo,inspect,replay,index,bench}``, one
module's ``main(argv)`` a command, dispatched by :mod:`energy_loader.__main__`."""
