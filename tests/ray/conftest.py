"""One-node Ray tests: the session-wide `ray_cluster` fixture (or a Ray the test's own driver starts).
Every test collected under this folder gets the `ray` marker."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.ray)
