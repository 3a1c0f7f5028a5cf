"""Unit tests: one process, no Ray, no process group (a CLI or helper subprocess at most).
Every test collected under this folder gets the `unit` marker."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.unit)
