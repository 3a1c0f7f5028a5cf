"""One Ray Tune run of a round's trials, in a Ray actor of its own that ends with the run.

Tune's driver loop leaves memory behind in the process that runs it: freed, but kept by the
allocators (glibc's arenas, Python's and Arrow's), growing with every trial while the live
objects stay flat (docs/performance.md, docs/scale.md). Run in the coordinator, which lasts the
whole study, that grew with the study; run here, it goes when the run ends. The callback sends
each trial event to the coordinator (`Coordinator.trial_event`) and waits for it, so events
arrive in order and the trial table holds every one of them when the run returns (the callback:
`tune_progress`). Ray Tune is imported where a Tune run or trial runs, not where this module is
(the coordinator's process, which starts every study, and `playbook run`)."""

from __future__ import annotations

import os

import ray

from service.core import storage
from service.orchestration.worker_console import quiet_tune
from service.study.search import Round
from service.study.spec import Study

# A Ray Train trial's Tune trial only drives its worker group, whose workers reserve the CPUs
# and GPUs. Tune needs every trial to reserve something, so it reserves a token of memory and
# no CPU: a layout that fills the cluster's CPUs exactly still starts (Tune runs no more
# trials at once than `max_concurrent_trials`).
TRIAL_DRIVER_MEMORY = 1 << 20
# Tune restarts a trial whose process died (a fast-path trial resumes from its latest
# checkpoint; a Ray Train trial's worker failures are retried by Ray Train itself first).
MAX_TRIAL_RESTARTS = 2


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


def trial_resources(study: Study):
    """What a Tune trial reserves: a fast-path trial its one worker's CPUs (and GPU); a
    pooled trial one bundle per worker (world rank 0 is the trial's own process, in the first);
    a Ray Train trial's driver no CPU or GPU (its workers reserve them)."""
    scaling = study.scaling
    worker = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {})}
    if is_fast_path(scaling):
        return {k.lower(): v for k, v in worker.items()}
    if reuses_workers(study):
        from ray import tune

        return tune.PlacementGroupFactory([worker] * scaling.world_size, strategy=placement_strategy(scaling))
    return {"cpu": 0, "memory": TRIAL_DRIVER_MEMORY}


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


def study_trainable(study: Study):
    """The study's Tune trainable: `tune_trial` with the study bound, registered under the
    study's own name. Tune looks trainables up by name in a registry shared by the whole Ray
    job, so two studies started from one job under one name would run each other's trials
    (with the other study's spec and storage)."""
    from ray import tune

    trainable = tune.with_parameters(tune_trial, study=study)
    trainable.__name__ = f"playbook-{study.name}"
    return tune.with_resources(trainable, trial_resources(study))


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
        import service.orchestration.tune_progress  # noqa: F401

    def fit(self, study: Study, name: str, configs: list[dict], concurrency: int, coordinator) -> None:
        # A trial's process (and its imports: torch, the workload) serves the run's next
        # trial instead of a new actor per trial. Each trial sets its own seeds, threads and
        # state, so what it computes does not depend on the process it lands in.
        from ray import tune

        tune_config = tune.TuneConfig(max_concurrent_trials=concurrency, reuse_actors=True)
        self._fit(study, name, coordinator, tune_config, {"trial": tune.grid_search(configs)})

    def fit_bayesian(
        self, study: Study, rnd: Round, rows: list[dict], num_trials: int, first_index: int, coordinator
    ) -> None:
        """A bayesian round's `num_trials` trials, suggested by its searcher one at a time: each
        suggestion sees every result before it, so the round does not depend on finish order."""
        from ray import tune

        from service.orchestration.bayesian_search import round_searcher

        searcher = round_searcher(study, rnd, rows, first_index)
        tune_config = tune.TuneConfig(
            search_alg=searcher, num_samples=num_trials, max_concurrent_trials=1, reuse_actors=True
        )
        self._fit(study, rnd.name, coordinator, tune_config, {})

    def _fit(self, study: Study, name: str, coordinator, tune_config, param_space: dict) -> None:
        fs, tune_path = storage.ray_storage(study.layout.tune_dir)
        self._tuner(study, name, coordinator, tune_config, param_space, fs, tune_path).fit()

    def _tuner(self, study: Study, name: str, coordinator, tune_config, param_space: dict, fs, tune_path):
        from ray import tune
        from ray.tune.logger import JsonLoggerCallback

        from service.orchestration.tune_progress import ProgressCallback

        return tune.Tuner(
            study_trainable(study),
            param_space=param_space,
            tune_config=tune_config,
            run_config=tune.RunConfig(
                name=name,
                storage_path=tune_path,
                storage_filesystem=fs,
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=MAX_TRIAL_RESTARTS),
                # Tune's result.json per trial (what its ResultGrid reads at the run's end); no
                # CSV or TensorBoard logs (see __init__).
                callbacks=[
                    ProgressCallback(coordinator, study.layout),
                    JsonLoggerCallback(),
                ],
            ),
        )
