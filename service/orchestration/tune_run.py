"""One Ray Tune run of a round's trials, in a Ray actor of its own that ends with the run.

Tune's driver loop leaves memory behind in the process that runs it: freed, but kept by the
allocators (glibc's arenas, Python's and Arrow's), growing with every trial while the live
objects stay flat (docs/performance.md, docs/scale.md). Run in the coordinator, which lasts the
whole study, that grew with the study; run here, it goes when the run ends. The callback sends
each trial event to the coordinator (`Coordinator.trial_event`) and waits for it, so events
arrive in order and the trial table holds every one of them when the run returns. Ray Tune is
imported where a Tune run or trial runs (`tune_fit`, which holds everything that needs it), not
where this module is (the coordinator's process, which starts every study, and `playbook run`)."""

from __future__ import annotations

import os

import ray

from service.core import storage
from service.orchestration.worker_console import quiet_tune
from service.study.search import Round
from service.study.spec import Study


def is_fast_path(scaling) -> bool:
    """Trials of one worker skip Ray Train and train in their Tune trial (`service.orchestration.fast_path`);
    several workers (or hosts) need its worker group."""
    return scaling.world_size == 1


def reuses_workers(study: Study) -> bool:
    """Multi-worker trials train on a pool of workers that a Tune run's next trial reuses
    (`service.orchestration.worker_pool`) unless the study turns it off
    (`scaling.reuse_workers: false`: a Ray Train run per trial)."""
    s = study.scaling
    return s.reuse_workers and s.world_size > 1


def placement_strategy(scaling) -> str:
    """One worker per host: each on its own node (STRICT_SPREAD). Several per host: PACK,
    which fills a node before the next, so nodes sized for `workers_per_host` workers get
    exactly that many. The layout actually obtained is what the data is sharded over, and it
    is recorded in the trial's topology.json (with a warning when it differs)."""
    if scaling.num_hosts > 1 and scaling.workers_per_host == 1:
        return "STRICT_SPREAD"
    return "PACK"


def worker_env(scaling) -> dict[str, str]:
    """A training worker's environment: its threads, and the storage settings of the driver."""
    return {"OMP_NUM_THREADS": str(int(max(1, scaling.cpus_per_worker))), **storage.forwarded_env()}


def tune_trial(config: dict, study: Study) -> None:
    """The Tune trial function. The trainer (torch, the workload) is imported in the trial's
    process only: a TuneRun process starts without those imports (docs/performance.md). A
    pooled trial's process first starts its pool's actors (unless it has them from the run's
    trial before), which start and import while it imports the trainer."""
    if reuses_workers(study):
        from service.orchestration import worker_pool

        worker_pool.start_pool(study.scaling)
    from service.orchestration import launch

    launch.tune_trial(config, study)


@ray.remote(num_cpus=0)
class TuneRun:
    def __init__(self):
        # Not Tune's default CSV and TensorBoard logs per trial: the trial's metrics.jsonl and
        # the trial table are its record, and Ray 2.60 keeps every trial's TensorBoard writer
        # (an open file, a lock, a thread) in the process after the trial ends.
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        quiet_tune()
        # Tune imported as the actor starts: the coordinator starts the next run's TuneRun
        # while the run before it goes on, so that the next one is ready.
        import service.orchestration.tune_fit  # noqa: F401

    def fit(self, study: Study, name: str, configs: list[dict], concurrency: int, coordinator) -> None:
        from service.orchestration import tune_fit

        tune_fit.grid_tuner(study, name, configs, concurrency, coordinator).fit()

    def fit_bayesian(
        self, study: Study, rnd: Round, rows: list[dict], num_trials: int, first_index: int, coordinator
    ) -> None:
        from service.orchestration import tune_fit

        tune_fit.bayesian_tuner(study, rnd, rows, num_trials, first_index, coordinator).fit()
