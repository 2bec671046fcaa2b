"""The drop-in loader: torch's DataLoader for plain datasets, with exact save and restore.

``SavableDataLoader(dataset, ...)`` with a dataset that is not a savable pipeline builds a
:class:`DropInDataLoader`. Modules: ``loader`` (the class), ``map_style`` and ``iterable``
(how each kind of dataset runs), ``sampling`` (the recorded index stream), ``state`` (the
saved format), ``_torch`` (every use of torch internals, in one place).
"""

from .loader import DropInDataLoader

__all__ = ["DropInDataLoader"]
