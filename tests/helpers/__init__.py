"""Helpers shared by integration tests (no fixtures here; those live in tests/conftest.py)."""
