"""Integrations with training frameworks (optional dependencies, imported on demand).

- :mod:`energy_loader.integrations.accelerate`: ``prepare_loader(accelerator, loader)`` for
  Hugging Face Accelerate;
- :mod:`energy_loader.integrations.transformers`: ``SavableLoaderTrainer`` for the Hugging
  Face ``Trainer``.

Each submodule imports its framework when it is imported, so ``import energy_loader`` never
needs them.
"""
