"""The command-line tools: ``python -m energy_loader {demo,inspect,replay,index,bench}``.

Each module's ``main(argv)`` is one command; :mod:`energy_loader.__main__` dispatches. They run
in the user's process and use the library's public face plus :mod:`energy_loader.loader.peek`.
"""
