"""A trial function's own report after its Ray Train run (the trial summary) while the run's
controller still has a report on its way to Tune. Ray Train's controller reports to Tune through an
inter-actor queue that the trial process's main thread moves onto a one-slot result queue; a
plain `ray.tune.report` from the function's thread could take that slot in between, and the main
thread then waited on it forever: a two-worker trial whose controller had exited hung until its
job ended, about one run in five (stacks: the main thread in `Queue.put` under
`_get_result_from_queues`, no training thread). `report_to_tune` keeps both in one queue."""

from __future__ import annotations

import threading

import pytest
from ray import tune

from tests.helpers.tune_reports import ROUNDS, controller_then_function

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_the_functions_reports_and_the_controllers_reach_tune_in_order(ray_cluster, tmp_path):
    out: dict = {}
    tuner = tune.Tuner(
        tune.with_resources(controller_then_function, {"cpu": 0.5}),
        run_config=tune.RunConfig(name="order", storage_path=str(tmp_path), verbose=0),
    )
    thread = threading.Thread(target=lambda: out.update(results=tuner.fit()), daemon=True)
    thread.start()
    thread.join(120)
    assert "results" in out, "the trial hung: its main thread waits on its own result queue"
    frame = out["results"][0].metrics_dataframe
    got = list(zip(frame["i"], frame["by_controller"], strict=True))
    assert got == [(i, by) for i in range(ROUNDS) for by in (1, 0)]
