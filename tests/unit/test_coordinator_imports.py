"""The coordinator's process starts every study, before any trial can, and `playbook run`
imports it too: importing it must import neither torch (the longest import of its start, and
memory held for the whole study; it did through `study.checks`, for `trial_footprint`, which
needs no workload) nor Ray Tune or Train (about as long again on two cores; it did through
`tune_run`'s callback and `ray_private`). Tune is imported where a Tune run or trial runs."""

from __future__ import annotations

from tests.helpers.processes import imported_along


def test_the_coordinator_imports_no_torch_and_no_tune():
    watched = ["torch", "ray.tune", "ray.train", "ray.data"]
    assert imported_along(["service.orchestration.coordinator"], watched) == []
