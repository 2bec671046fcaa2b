"""Integrations with training frameworks, one module per framework.

Each module imports its framework itself; this package imports nothing, so importing it never
needs an optional dependency.
"""
