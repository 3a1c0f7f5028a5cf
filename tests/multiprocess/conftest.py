"""Multi-process tests: torch.distributed gloo process groups in forked processes (`helpers.gloo`), no Ray.
Every test collected under this folder gets the `multiprocess` marker."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.multiprocess)
