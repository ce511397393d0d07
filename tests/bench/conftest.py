"""Fixtures for bench tests: the small stories260K dataset the training tests distil (tests/training/conftest.py)."""

from tests.training.conftest import stories_dataset  # noqa: F401  (a fixture: pytest finds it here by name)
