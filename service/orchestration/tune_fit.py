"""Everything that needs Ray Tune (and with it Ray Train, Ray Data and pandas), imported only
in the process that runs a Tune run (`tune_run.TuneRun`): the study's trainable and what each of
its trials reserves, the Tuner of a round, and the callback that sends Tune's trial events to
the study's coordinator."""

from __future__ import annotations

import ray
from ray import tune
from ray.tune.logger import JsonLoggerCallback

from service.core import storage
from service.core.trial_status import TrialStatus
from service.orchestration.tune_run import is_fast_path, placement_strategy, reuses_workers, tune_trial
from service.study.layout import StudyLayout
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


def grid_tuner(study: Study, name: str, configs: list[dict], concurrency: int, coordinator) -> tune.Tuner:
    """A Tune run of the given trials. A trial's process (and its imports: torch, the
    workload) serves the run's next trial instead of a new actor per trial. Each trial sets its
    own seeds, threads and state, so what it computes does not depend on the process it lands in."""
    tune_config = tune.TuneConfig(max_concurrent_trials=concurrency, reuse_actors=True)
    return _tuner(study, name, coordinator, tune_config, {"trial": tune.grid_search(configs)})


def bayesian_tuner(
    study: Study, rnd: Round, rows: list[dict], num_trials: int, first_index: int, coordinator
) -> tune.Tuner:
    """A bayesian round's `num_trials` trials, suggested by its searcher one at a time: each
    suggestion sees every result before it, so the round does not depend on finish order."""
    from service.orchestration.bayesian_search import round_searcher

    searcher = round_searcher(study, rnd, rows, first_index)
    tune_config = tune.TuneConfig(
        search_alg=searcher, num_samples=num_trials, max_concurrent_trials=1, reuse_actors=True
    )
    return _tuner(study, rnd.name, coordinator, tune_config, {})


def _tuner(
    study: Study, name: str, coordinator, tune_config: tune.TuneConfig, param_space: dict
) -> tune.Tuner:
    fs, tune_path = storage.ray_storage(study.layout.tune_dir)
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
            # Tune's result.json per trial (what its ResultGrid reads at the run's end); no CSV
            # or TensorBoard logs (`TuneRun.__init__`).
            callbacks=[ProgressCallback(coordinator, study.layout), JsonLoggerCallback()],
        ),
    )


def study_trainable(study: Study):
    """The study's Tune trainable: `tune_run.tune_trial` with the study bound, registered under
    the study's own name. Tune looks trainables up by name in a registry shared by the whole Ray
    job, so two studies started from one job under one name would run each other's trials
    (with the other study's spec and storage)."""
    trainable = tune.with_parameters(tune_trial, study=study)
    trainable.__name__ = f"playbook-{study.name}"
    return tune.with_resources(trainable, trial_resources(study))


def trial_resources(study: Study):
    """What a Tune trial reserves: a fast-path trial its one worker's CPUs (and GPU); a
    pooled trial one bundle per worker (world rank 0 is the trial's own process, in the first);
    a Ray Train trial's driver no CPU or GPU (its workers reserve them)."""
    scaling = study.scaling
    worker = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {})}
    if is_fast_path(scaling):
        return {k.lower(): v for k, v in worker.items()}
    if reuses_workers(study):
        return tune.PlacementGroupFactory([worker] * scaling.world_size, strategy=placement_strategy(scaling))
    return {"cpu": 0, "memory": TRIAL_DRIVER_MEMORY}


class ProgressCallback(tune.Callback):
    """Sends Tune's trial events to the coordinator. Holds only its handle and the study's
    layout: Tune pickles its callbacks with the experiment state."""

    def __init__(self, coordinator, layout: StudyLayout):
        self.coordinator, self.layout = coordinator, layout

    def _send(self, kind: str, trial, *args) -> None:
        ray.get(self.coordinator.trial_event.remote(kind, trial.config["trial"], *args))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._send("started", trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("summary") and result.get("status") == TrialStatus.FAILED.reported:
            # A final error: the trial function ended it without a retry (`launch.tune_trial`),
            # its message already in the trial's error.txt; full storage stops the study too.
            self._send("stopped" if result.get("stops_study") else "error", trial, result["error"])
            return
        self._send("result", trial, {k: v for k, v in result.items() if k != "config"})

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._send("complete", trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        """A trial that failed after Tune's retries: its error's last line to the trial row,
        the whole of Tune's error file (every attempt's traceback, in Ray's session folder on
        this node) to the trial's error.txt in the study's storage."""
        text = ""
        if trial.error_file:
            try:
                with open(trial.error_file) as f:
                    text = f.read()
            except OSError:
                pass
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            self._send("error", trial, "failed (no error recorded)")
            return
        uri = self.layout.trial(trial.config["trial"]["trial_name"]).error_file
        storage.write_bytes_atomic(uri, text.encode())
        self._send("error", trial, f"{lines[-1]} (all of it: {uri})")
