"""Cluster tests: each starts its own Ray (`ray start --head`, ray.cluster_utils.Cluster); run by
`pytest -m cluster`, after the other tiers.
Every test collected under this folder gets the `cluster` marker."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.cluster)
