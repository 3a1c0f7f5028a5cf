"""Fault injection and bad input on one node: killed processes, torn checkpoints, failing storage,
refused inputs.
Every test collected under this folder gets the `faults` marker."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.faults)
