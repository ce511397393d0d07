"""Fixtures shared by the heads tests."""

import pytest

from tests.heads.helpers import tiny_target


@pytest.fixture(scope="module")
def target():
    """The tiny target every heads test builds its heads for (one per test module)."""
    return tiny_target()
