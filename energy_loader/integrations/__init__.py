"""Integrations with training frameworks, one module per framework: ``lightning``
(``SavableLoaderCallback``), ``accelerate`` (``prepare_loader``) and ``transformers``
(``SavableLoaderTrainer``). Each imports its framework when imported; this package imports
nothing, so ``import energy_loader`` never needs them.
"""
