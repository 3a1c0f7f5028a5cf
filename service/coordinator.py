"""The per-study coordinator: a named Ray actor that plans each round, runs it through Ray
Tune (one Tune trial = one Ray Train run), keeps the trial table and answers status calls."""

from __future__ import annotations

import math
import os
import time

import ray
from ray import tune
from ray.tune.logger import JsonLoggerCallback
from ray.util.debug import reset_log_once

from service import fast_path, launch, observe, spec, storage, tracking
from service.analysis.input_bound import INPUT_ROW_FIELDS
from service.analysis.report_lines import log_lines, round_verdicts
from service.analysis.verdicts import best_step_position
from service.errors import PlaybookError
from service.progress import ProgressLimiter, progress_line
from service.rounds import plan_round
from service.spec import Round, Study
from service.tracking import TrialTable

NAMESPACE = "playbook"
# The Tune trial function only drives a Ray Train run (whose workers reserve the real CPUs);
# it reserves a token share so that it never blocks the workers. Concurrency is capped by
# max_concurrent_trials instead. (A one-worker trial trains in the Tune trial itself and
# reserves that worker's share: `fast_path.fast_path_resources`.)
TRIAL_DRIVER_CPU = 0.01
# Tune restarts a trial whose process died (a fast-path trial resumes from its latest
# checkpoint; a Ray Train trial's worker failures are retried by Ray Train itself first).
MAX_TRIAL_RESTARTS = 2
# A round runs as Tune runs of at most max(MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS x its
# concurrency) trials (unless the round says `trials_per_tune_run`): Tune holds ~185 KB per
# trial until its run ends (bench/tune_memory.py), and each run costs 2-8 s to start and end
# plus its tail, where slots idle while the last trials finish (~1/(2 x 32) of its slot time).
MIN_TRIALS_PER_TUNE_RUN = 512
TUNE_RUN_SLOT_TRIALS = 32
# A trial whose row has one of these is over; a rerun of the study does not start it again.
DONE = ("FINISHED", "DIVERGED")


def actor_name(study_name: str) -> str:
    return f"study-{study_name}"


class ProgressCallback(tune.Callback):
    """Turns Tune events into trial-table rows and progress lines in the job log. Holds only
    the study name: Tune pickles its callbacks with the experiment state."""

    def __init__(self, study_name: str, metric: str):
        self.study_name, self.metric = study_name, metric

    def _table(self) -> TrialTable:
        return tracking.registered(self.study_name)

    def _observers(self) -> observe.StudyObservers | None:
        return observe.registered(self.study_name)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._table().update(trial.config["trial"]["trial_name"], status="RUNNING")
        self._table().save_soon()  # and the study's index row (the table's on_save)
        if self._observers() and self._observers().mirror:
            self._observers().mirror.trial_started(trial.config["trial"])

    def on_trial_result(self, iteration, trials, trial, result, **info):
        name = trial.config["trial"]["trial_name"]
        observers = self._observers()
        if observers and not result.get("summary"):
            observers.metrics.on_report(name, result, self.metric)
            if observers.mirror:
                observers.mirror.report(name, result)
        if result.get("summary"):
            status = {"diverged": "DIVERGED"}.get(result.get("status"), "FINISHED")
            row = self._table().update(
                name,
                status=status,
                step=result.get("last_step"),
                best_metric=result.get(self.metric),
                best_step=result.get("best_step"),
                best_checkpoint=result.get("best_checkpoint"),
                diverged_at_step=result.get("diverged_at_step"),
                **{k: result.get(k) for k in INPUT_ROW_FIELDS},
            )
            if status == "FINISHED" and row.get("best_step") is not None:
                verdict = best_step_position(name, row["best_step"], row["max_train_steps"])
                self._table().update(name, step_verdict=verdict.message if verdict.is_warning else "ok")
            print(
                f"[{name}] {status.lower()}: best {self.metric}={_fmt(row.get('best_metric'))} "
                f"at step {row.get('best_step')}",
                flush=True,
            )
            if observers:
                observers.metrics.on_trial_done(name)
                if observers.mirror:
                    observers.mirror.trial_done(name, row)
            return
        step, total = result.get("step"), trial.config["trial"]["max_train_steps"]
        self._table().update(name, status="RUNNING", step=step, metric=result.get(self.metric))
        limiter = observers.limiter if observers else ProgressLimiter(0)
        if limiter.should_print(name, step, total):
            print(progress_line(name, result, total, self.metric), flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._table().save_soon()

    def on_trial_error(self, iteration, trials, trial, **info):
        error = str(trial.error_file or "failed")
        name = trial.config["trial"]["trial_name"]
        row = self._table().update(name, status="FAILED", error=error)
        self._table().save_soon()
        if self._observers():
            self._observers().metrics.on_trial_done(name)
            if self._observers().mirror:
                self._observers().mirror.trial_done(name, row)
        print(f"[{trial.config['trial']['trial_name']}] FAILED (see {error})", flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def study_trainable(study: Study):
    """The study's Tune trainable: `launch.tune_trial` with the study bound, registered under
    the study's own name. Tune looks trainables up by name in a registry shared by the whole
    Ray job, so two studies started from one job under one name would run each other's trials
    (with the other study's spec and storage)."""
    trainable = tune.with_parameters(launch.tune_trial, study=study)
    trainable.__name__ = f"playbook-{study.name}"
    s = study.scaling
    resources = fast_path.fast_path_resources(s) if fast_path.is_fast_path(s) else {"cpu": TRIAL_DRIVER_CPU}
    return tune.with_resources(trainable, resources)


@ray.remote(num_cpus=0, max_concurrency=4)
class Coordinator:
    def __init__(self, study: Study):
        self.study = study
        self.observers = observe.StudyObservers.for_study(study)
        self.table = TrialTable(
            study.study_uri, study.training.metric, study.training.mode, on_save=self.observers.rows_changed
        )
        self.table.load_existing()
        tracking.register(study.name, self.table)
        self.observers.limiter = ProgressLimiter(study.tracking.progress_interval_s)
        observe.register(self.observers)
        self.observers.metrics.start_republishing()
        self.state = "starting"
        self.current_round: str | None = None
        # Not Tune's default CSV and TensorBoard logs per trial: the trial's metrics.jsonl and
        # the trial table are its record, and Ray 2.60 keeps every trial's TensorBoard writer
        # (an open file, a lock, a thread) in this process after the trial ends.
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"

    def run(self) -> list[dict]:
        storage.write_bytes_atomic(
            storage.join(self.study.study_uri, "study.yaml"), spec.dump_yaml(self.study).encode()
        )
        summaries = []
        self.observers.rows_changed(self.table.snapshot())
        for rnd in self.study.rounds:
            self.current_round, self.state = rnd.name, "running"
            try:
                self._run_round(rnd)
            except BaseException:
                self._write_rows(state="stopped")
                raise
            summary = round_verdicts(self.study, rnd.name, self.table.snapshot())
            summaries.append(summary)
            storage.write_json(storage.join(self.study.study_uri, "verdicts.json"), summaries)
            for line in log_lines(summary):
                print(line, flush=True)
        self.state = "finished"
        self._write_rows(state="finished")
        return self.table.snapshot()

    def _write_rows(self, state: str) -> None:
        """The trial table now (a coalesced write still waiting is done here, not after this),
        then the study's index row with its final state."""
        self.table.save()
        self.observers.rows_changed(self.table.snapshot(), state=state)

    def _run_round(self, rnd: Round) -> None:
        configs = plan_round(self.study, rnd, self.table.snapshot())
        for c in configs:
            if c["trial_name"] not in self.table.rows:
                self.table.update(
                    c["trial_name"],
                    round=rnd.name,
                    status="PENDING",
                    max_train_steps=c["max_train_steps"],
                    **{f"hp/{k}": v for k, v in c["hparams"].items()},
                    **{k: c[k] for k in ("seed", "extended_from", "schedule_origin") if k in c},
                )
        self.table.save()
        # The trial table, not Tune's experiment state, says what is done: Tune snapshots its
        # state every few seconds, so a driver killed just after a trial ended would have Tune
        # run that trial again. Trials not done are started anew and resume from their own
        # checkpoints on storage (a Train run is named after its trial; the fast path reads the
        # trial folder), so restoring Tune's experiment adds nothing.
        todo = [c for c in configs if self.table.rows[c["trial_name"]].get("status") not in DONE]
        if len(todo) < len(configs):
            print(
                f"round {rnd.name}: resuming from {self.study.study_uri}: "
                f"{len(configs) - len(todo)} of {len(configs)} trials already done",
                flush=True,
            )
        if not todo:
            return
        concurrency = self._concurrency(rnd)
        size = rnd.trials_per_tune_run or max(MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS * concurrency)
        runs = math.ceil(len(todo) / size)
        print(
            f"round {rnd.name}: {len(todo)} trials, at most {concurrency} at once"
            + (f", in {runs} Tune runs of up to {size}" if runs > 1 else ""),
            flush=True,
        )
        trainable = study_trainable(self.study)  # once a round: it puts the study in Ray's store
        for start in range(0, len(todo), size):
            self._tune_run(trainable, rnd.name, todo[start : start + size], concurrency)

    def _tune_run(self, trainable, name: str, configs: list[dict], concurrency: int) -> None:
        """One Ray Tune run over these trial configs. Everything Tune keeps per trial is freed
        when it returns: the trial table holds what the study keeps."""
        fs, tune_path = storage.ray_storage(storage.join(self.study.study_uri, "tune"))
        tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(configs)},
            # A trial's process (and its imports: torch, the workload) serves the run's next
            # trial instead of a new actor per trial. Each trial sets its own seeds, threads and
            # state, so what it computes does not depend on the process it lands in.
            tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, reuse_actors=True),
            run_config=tune.RunConfig(
                name=name,
                storage_path=tune_path,
                storage_filesystem=fs,
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=MAX_TRIAL_RESTARTS),
                # Tune's result.json per trial (what its ResultGrid reads at the run's end); no
                # CSV or TensorBoard logs (see __init__).
                callbacks=[
                    ProgressCallback(self.study.name, self.study.training.metric),
                    JsonLoggerCallback(),
                ],
            ),
        ).fit()
        # Tune's JSON encoder of its experiment state logs "once" per distinct value it cannot
        # encode (each trial's last-5/last-10 metric windows: ~28 keys a trial), in a set
        # that lives as long as the process: forget them with the run.
        reset_log_once()

    def _concurrency(self, rnd: Round) -> int:
        if rnd.max_concurrent_trials:
            return rnd.max_concurrent_trials
        s = self.study.scaling
        resources = ray.cluster_resources()
        fits = resources.get("CPU", 0) // (s.cpus_per_worker * s.world_size)
        if s.use_gpu:
            fits = min(fits, resources.get("GPU", 0) // s.world_size)
        return max(1, int(fits))

    def status(self) -> dict:
        return {
            "study": self.study.name,
            "state": self.state,
            "round": self.current_round,
            "metric": self.study.training.metric,
            "mode": self.study.training.mode,
            "trials": self.table.snapshot(),
            "time": time.time(),
        }


def run_study(study: Study) -> list[dict]:
    """Start the study's coordinator on the connected Ray cluster and wait for it."""
    name = actor_name(study.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        raise PlaybookError(f"study {study.name!r} is already running on this cluster")
    except ValueError:
        pass
    env = storage.forwarded_env()  # merged into the job's runtime env (a gs:// emulator, ...)
    coordinator = Coordinator.options(
        name=name, namespace=NAMESPACE, **({"runtime_env": {"env_vars": env}} if env else {})
    ).remote(study)
    try:
        return ray.get(coordinator.run.remote())
    finally:
        ray.kill(coordinator)


def live_status(study_name: str) -> dict | None:
    """Ask the running coordinator, if there is one on the connected cluster."""
    try:
        actor = ray.get_actor(actor_name(study_name), namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(actor.status.remote(), timeout=30)
