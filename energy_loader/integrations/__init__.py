"""Integrations with training frameworks, one module per framework (optional dependencies).

- :mod:`energy_loader.integrations.lightning`: ``SavableLoaderCallback`` for PyTorch Lightning;
- :mod:`energy_loader.integrations.accelerate`: ``prepare_loader(accelerator, loader)`` for
  Hugging Face Accelerate;
- :mod:`energy_loader.integrations.transformers`: ``SavableLoaderTrainer`` for the Hugging
  Face ``Trainer``.

Each submodule imports its framework when it is imported; this package imports nothing, so
``import energy_loader`` never needs them.
"""
