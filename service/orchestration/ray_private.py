"""Every use of Ray's private APIs, in one place, pinned to the Ray version in pyproject.toml.
Each is here because no public API does the job; a Ray upgrade is checked against this module
(and its tests: test_data_errors, test_fault_driver_kill, test_cluster_capacity,
test_tune_report_order_ray, test_orphaned_groups_ray)."""

from __future__ import annotations

import os
import time

import ray
from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR, _enable_token_auth
from ray._private.ray_logging import global_worker_stdstream_dispatcher
from ray._private.state import state
from ray.core.generated.gcs_pb2 import PlacementGroupTableData
from ray.exceptions import RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from service.core.errors import DataError, SpecError, StorageFull, storage_full


def token_auth_without_warning() -> None:
    """Token authentication for the local Ray this process is about to start, which is Ray's own
    default, without the WARNING that Ray's default prints on every start. Ray reads its
    config once, at import, so setting RAY_AUTH_MODE alone would leave this process (the
    driver) outside its own cluster's authentication; Ray's helper refreshes that config too.
    A RAY_AUTH_MODE of the user's own is left as it is."""
    if AUTH_MODE_ENV_VAR not in os.environ:
        _enable_token_auth()


RAY_NOISE = ("has constructor arguments in the object store and max_restarts > 0",)
"""Parts of lines that Ray's own processes print and that no user can act on: Ray Train's
controller starts a `PreemptionWatcher` actor for every Ray Train run in the way Ray core
reports as an error (ray-project/ray#53727), one line per trial."""


def drop_ray_noise() -> None:
    """The lines Ray forwards from its processes to this driver, less those of `RAY_NOISE`.
    Call once, after `ray.init`; Ray's log files keep every line."""
    dispatcher = global_worker_stdstream_dispatcher

    def without_noise(handler):
        def handle(data: dict) -> None:
            lines = [line for line in data["lines"] if not any(n in line for n in RAY_NOISE)]
            if lines:
                handler({**data, "lines": lines})

        return handle

    with dispatcher._lock:
        dispatcher.handlers = [
            (name, without_noise(h) if name == "ray_print_logs" else h) for name, h in dispatcher.handlers
        ]


def cluster_config() -> dict | None:
    """The autoscaler's cluster config (its node types and their maximum counts), None on a
    fixed cluster."""
    return state.get_cluster_config()


def final_error_of(error: BaseException, uri: str) -> DataError | SpecError | StorageFull | None:
    """The error behind a trial's failure that every try would meet again: bad data, a study
    field that the model needs set otherwise (`trainer.step.check_every_gradient`), or full
    storage (named by `uri` where the error names no file); raised in this process (the fast
    path), by a pool's actor (a RayTaskError, whose text is the actor's whole traceback, around
    the error itself), by a Ray Train worker (wrapped in a WorkerGroupError, each worker's error
    with its traceback; a checkpoint Ray Train's report could not copy to storage among them),
    or by Ray Train's controller (a ControllerError)."""
    causes = [error, *(getattr(f, "_base_exc", f) for f in getattr(error, "worker_failures", {}).values())]
    causes.append(getattr(error, "controller_failure", None))  # Ray Train's own writes (its snapshot)
    for cause in causes:
        if isinstance(cause, RayTaskError):
            cause = cause.cause
        if isinstance(cause, DataError | SpecError):
            return cause
        if full := storage_full(uri, cause):
            return full
    return None


def trainer_class():
    """A TorchTrainer whose runs fail at once on a data error: Ray Train's default failure
    policy (a worker group failure is retried up to FailureConfig.max_failures times), except
    that the same data gives the same error on every try. The policy is set through
    `_initialize_and_run_controller` and Ray Train's internal `DefaultFailurePolicy`, the one
    hook that decides whether a failure is retried. Made on call: ray.train.torch costs seconds
    of imports that fast-path trials and the coordinator skip."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    class DataErrorsAreFinal(DefaultFailurePolicy):
        def make_decision(self, training_failed_error) -> FailureDecision:
            if final_error_of(training_failed_error, "") is not None:
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    class Trainer(TorchTrainer):
        def _initialize_and_run_controller(self, **kwargs):
            kwargs["failure_policy"] = DataErrorsAreFinal(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**kwargs)

    return Trainer


REPORT_POLL_S = 0.05


def report_to_tune(metrics: dict) -> None:
    """`ray.tune.report` from a trial function's own thread, after what its Ray Train
    controller reported has reached Tune. The controller reports through an inter-actor queue
    that the trial process's main thread takes from and puts on a one-slot result queue; a
    report from the function's thread (this one, or the one Tune adds when the function returns)
    could take that slot in between, and the main thread, the slot's only reader, then waited on
    it forever (`_TrainSession._get_result_from_queues`): a trial whose controller had exited
    hung until its job ended, about one two-worker trial in five on two busy CPUs. An empty item
    put behind the controller's last one, which that loop takes and skips, is gone only once
    the loop is done with the item before it."""
    import ray.tune
    from ray.train._internal.session import get_session

    queue = getattr(get_session(), "_inter_actor_queue", None)
    if queue is not None:
        queue.put({})
        while not queue.empty():
            time.sleep(REPORT_POLL_S)
    ray.tune.report(metrics)


def remove_placement_groups_of(actor) -> int:
    """Remove the placement groups that an actor (its handle) created and that are still there. In Ray 2.60
    a placement group made by a non-detached actor lasts until its creator actor *and* its job
    are dead, so the trials' groups of a TuneRun that died would hold their CPUs for the rest
    of the job (and starve the run started in its place)."""
    actor_id = actor._actor_id.binary()
    return _remove_placement_groups(lambda pg: pg.creator_actor_id == actor_id)


def remove_orphaned_placement_groups() -> int:
    """Remove this job's placement groups whose creator actor is dead: a Ray Train controller
    killed while it starts its worker group leaves one (Ray keeps a group until its creator actor
    *and* its job are dead; Ray Train's own cleaner learns of a group only once its workers are
    up), and so does a killed TuneRun. Groups that no actor made (a driver's or a task's: Ray
    counts their creator as dead from the start) and other jobs' groups are left alone."""
    job = ray.get_runtime_context().get_job_id()
    no_actor = ray.ActorID.nil().binary()
    return _remove_placement_groups(
        lambda pg: (
            pg.creator_actor_dead
            and pg.creator_actor_id != no_actor
            and pg.creator_job_id.hex() == job
            and not pg.is_detached
        )
    )


def _remove_placement_groups(chosen) -> int:
    removed = 0
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = PlacementGroupTableData.FromString(raw)
        if chosen(pg) and pg.state != PlacementGroupTableData.REMOVED:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            removed += 1
    return removed


def optuna_trial_of(searcher, trial_id: str):
    """The optuna trial behind a Tune trial of an `OptunaSearch` (its `_ot_trials`): Tune tells
    optuna only a trial's value, and a diverged trial's constraint is set on it before that."""
    return searcher._ot_trials[trial_id]


def metrics_export_interval_s() -> float:
    """How often a Ray process exports its metrics to its node's agent: `metrics_report_interval_ms`
    (`RAY_metrics_report_interval_ms`), floored at 1 s as Ray's emitter floors it. The agent
    drops a gauge not re-sent for two of these (`open_telemetry_metric_recorder`)."""
    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000
