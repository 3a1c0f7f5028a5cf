"""The coordinator's process starts every study, before any trial can: importing it must not
import torch (the longest import of its start, and memory held for the whole study). It did
through `study.checks`, for `trial_footprint`, which needs no workload."""

from __future__ import annotations

from tests.helpers.processes import imported_along


def test_the_coordinator_imports_no_torch():
    assert imported_along(["service.orchestration.coordinator"], ["torch"]) == []
