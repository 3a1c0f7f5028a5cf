"""A Tune trial function that reports as a Ray Train run inside a Tune trial does: each round, a
report as Ray Train's controller sends it (its TuneReportCallback, through the trial's
inter-actor queue), then one of the function's own (`report_to_tune`), as the trial summary
follows the run's last report (tests/ray/test_tune_report_order_ray.py)."""

from __future__ import annotations

from service.orchestration.ray_private import report_to_tune

ROUNDS = 20


def controller_then_function(config):
    from ray.train._internal.session import get_session

    queue = get_session()._get_or_create_inter_actor_queue()
    for i in range(ROUNDS):
        queue.put({"i": i, "by_controller": 1})
        report_to_tune({"i": i, "by_controller": 0})
