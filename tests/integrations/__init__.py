"""Tests for energy_loader.integrations."""
