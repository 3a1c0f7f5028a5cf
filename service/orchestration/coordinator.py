"""The per-study coordinator: a named Ray actor that plans each round, runs it through Ray
Tune (one Tune trial = one Ray Train run; each Tune run in a `TuneRun` actor of its own),
keeps the trial table and answers status calls."""

from __future__ import annotations

import ctypes
import math
import time

import ray

from service.analysis.report_lines import log_lines, round_verdicts
from service.core import storage
from service.core.errors import StorageFull
from service.core.formatting import trial_count
from service.core.trial_status import DONE, TrialStatus
from service.orchestration.actor_options import on_this_node
from service.orchestration.ray_private import remove_orphaned_placement_groups, remove_placement_groups_of
from service.orchestration.study_metrics import StudyMetrics
from service.orchestration.tune_run import TuneRun
from service.planning import bayesian
from service.planning.rounds import as_source_rows, plan_round, row_fields
from service.study import spec
from service.study.checks import trial_footprint
from service.study.layout import StudyLayout
from service.study.search import Round
from service.study.spec import Study
from service.tracking import observe
from service.tracking.console import ConsoleLines
from service.tracking.progress import ProgressLimiter
from service.tracking.trial_events import TrialEvents
from service.tracking.trial_table import TrialTable, read_rows

NAMESPACE = "playbook"
# A round runs as Tune runs of at most max(MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS x its
# concurrency) trials (unless the round says `trials_per_tune_run`): Tune holds each trial's
# state in its TuneRun process until the run ends (bench/tune_memory.py), and each run costs a
# start, an end and a tail, where slots idle while the last trials finish (docs/performance.md).
MIN_TRIALS_PER_TUNE_RUN = 512
TUNE_RUN_SLOT_TRIALS = 32
# A Tune run whose TuneRun process died is started again (for its trials not done) this often.
MAX_TUNE_RUN_RESTARTS = 2
ORPHAN_SWEEP_S = 5.0
"""How often a running round removes the placement groups that dead actors of this job hold."""


def actor_name(study_name: str) -> str:
    return f"study-{study_name}"


def return_large_frees_to_the_os() -> None:
    """Fix glibc's mmap threshold at its default 128 KB. glibc raises it (up to 32 MB) each
    time a large block is freed; after that, large transient buffers (the trial table's
    rewrites grow with the study, Ray's 1 MB serialization buffers) come from the heap and
    stay resident once freed, so the coordinator grew with every trial; fixing the threshold
    cut that growth (docs/performance.md, docs/scale.md). Not glibc: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@ray.remote(num_cpus=0, max_concurrency=4)
class Coordinator:
    def __init__(self, study: Study):
        return_large_frees_to_the_os()  # this process lasts the whole study
        self.study = study
        self.observers = observe.StudyObservers.for_study(
            study, StudyMetrics(study.name, study.training.mode)
        )
        self.table = TrialTable(
            study.study_uri, study.training.metric, study.training.mode, on_save=self.observers.rows_changed
        )
        self.table.load_existing()
        self.observers.limiter = ProgressLimiter(study.tracking.progress_interval_s)
        self.console = ConsoleLines()  # what the study says to its user (`console_lines`)
        self.events = TrialEvents(self.table, self.observers, study.training.metric, self.console)
        self.observers.metrics.start_republishing()
        self.state = "starting"
        self.current_round: str | None = None
        self.spare_runner = None  # a started TuneRun for the next Tune run
        self.storage_full: StorageFull | None = None  # what stops the study after this round

    def run(self) -> list[dict]:
        # The first round's TuneRun starts (its process and imports) while the study is set up.
        self.spare_runner = tune_runner()
        try:
            return self._run()
        except StorageFull as e:  # the trial table's or the study's own files
            raise e.advised() from None
        finally:
            if self.spare_runner is not None:
                ray.kill(self.spare_runner)

    def _run(self) -> list[dict]:
        storage.write_bytes_atomic(self.study.layout.study_file, spec.dump_yaml(self.study).encode())
        summaries, stored = [], self._stored_verdicts()
        self.observers.rows_changed(self.table.snapshot())
        for i, rnd in enumerate(self.study.rounds):
            self.current_round, self.state = rnd.name, "running"
            try:
                started = self._run_round(rnd, last=i + 1 == len(self.study.rounds))
                if self.storage_full is not None:  # the next trials would meet it too
                    raise self.storage_full
            except BaseException:
                self._stopped()
                raise
            # A round that was over before this run keeps the verdicts it was given (a study
            # that grows by a round leaves its finished rounds as they were).
            summary = None if started else stored.get(rnd.name)
            summary = summary or round_verdicts(self.study, rnd.name, self.table.snapshot())
            summaries.append(summary)
            storage.write_json(self.study.layout.verdicts, summaries)
            for line in log_lines(summary):
                self.console.say(line)
        self.state = "finished"
        self._write_rows(state="finished")
        return self.table.snapshot()

    def stop(self) -> None:
        """The command that runs the study was stopped: save the trial table as it is (the
        running trials STOPPED at their last steps) and the study's index row as `stopped`,
        which later events and writes of this coordinator, about to be ended, leave as they are."""
        self._stopped()
        self.table.on_save = None

    def _stopped(self) -> None:
        self.state = "stopped"
        self.events.study_stopped()
        self._write_rows(state="stopped")

    def _write_rows(self, state: str) -> None:
        """The trial table now (a coalesced write still waiting is done here, not after this),
        then the study's index row with its final state."""
        self.table.save()
        self.observers.rows_changed(self.table.snapshot(), state=state)

    def _stored_verdicts(self) -> dict[str, dict]:
        """The verdicts.json summaries a run before this one saved, by round."""
        return {s["round"]: s for s in storage.read_json(self.study.layout.verdicts, [])}

    def _planning_rows(self, rnd: Round) -> list[dict]:
        """The trial rows a round is planned from: the study's, and, for a round that builds on
        another study's round, that study's (named `<study>/<trial>`, see `as_source_rows`)."""
        rows = self.table.snapshot()
        if rnd.from_other_study:
            other = rnd.from_round.split("/", 1)[0]
            rows += as_source_rows(other, read_rows(StudyLayout.of(self.study.storage, other).uri))
        return rows

    def _run_round(self, rnd: Round, last: bool) -> int:
        """Run the round's trials that are not done; how many that was."""
        if rnd.kind == "bayesian":
            return self._run_bayesian(rnd, last)
        configs = plan_round(self.study, rnd, self._planning_rows(rnd))
        for c in configs:
            if c["trial_name"] not in self.table.rows:
                self.table.update(
                    c["trial_name"],
                    round=rnd.name,
                    status=TrialStatus.PENDING,
                    max_train_steps=c["max_train_steps"],
                    **row_fields(c),
                )
        self.table.save()
        # The trial table, not Tune's experiment state, says what is done: Tune snapshots its
        # state every few seconds, so a driver killed just after a trial ended would have Tune
        # run that trial again. Trials not done are started anew and resume from their own
        # checkpoints on storage (a Train run is named after its trial; the fast path reads the
        # trial folder), so restoring Tune's experiment adds nothing.
        todo = self._not_done(configs)
        if len(todo) < len(configs):
            self.console.say(
                f"round {rnd.name}: resuming from {self.study.study_uri}: "
                f"{len(configs) - len(todo)} of {trial_count(len(configs))} already done"
            )
        if not todo:
            return 0
        concurrency = self._concurrency(rnd)
        size = rnd.trials_per_tune_run or max(MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS * concurrency)
        runs = math.ceil(len(todo) / size)
        self.console.say(
            f"round {rnd.name}: {trial_count(len(todo))}, at most {concurrency} at once"
            + (f", in {runs} Tune runs of up to {size}" if runs > 1 else "")
        )
        self._tune_runs(rnd.name, [todo[i : i + size] for i in range(0, len(todo), size)], concurrency, last)
        return len(todo)

    def _run_bayesian(self, rnd: Round, last: bool) -> int:
        """One Tune run whose searcher plans the round's trials one at a time; their rows appear
        as they start (`trial_event`). A resumed round runs only the trials it still lacks."""
        todo, first = bayesian.remaining(rnd, self.table.snapshot())
        self.console.say(f"round {rnd.name}: {trial_count(todo)}, one at a time (bayesian)")
        if not todo:
            return 0
        runner = self.spare_runner or tune_runner()
        self.spare_runner = None if last else tune_runner()
        me = ray.get_runtime_context().current_actor
        try:
            _await_sweeping(
                runner.fit_bayesian.remote(self.study, rnd, self._planning_rows(rnd), todo, first, me)
            )
        finally:
            ray.kill(runner)
            remove_placement_groups_of(runner)
        return todo

    def _tune_runs(self, name: str, runs: list[list[dict]], concurrency: int, last_round: bool) -> None:
        """Consecutive Ray Tune runs over these trial configs, each in a `TuneRun` actor that
        ends with it (what Tune's driver loop leaves behind goes with its process). Their trial
        events come back through `trial_event`: the trial table holds what the study keeps."""
        for i, configs in enumerate(runs):
            runner = self.spare_runner or tune_runner()
            # The next run's TuneRun starts (imports, Tune's set-up) while this one runs.
            self.spare_runner = tune_runner() if i + 1 < len(runs) or not last_round else None
            self._fit(runner, name, configs, concurrency)

    def _fit(self, runner, name: str, configs: list[dict], concurrency: int) -> None:
        """One Tune run on `runner`, which is killed when it ends. A TuneRun whose process dies
        (killed, out of memory, its node lost) takes its trials' processes with it; a new one
        runs the trials not done yet, which resume from their checkpoints, up to
        MAX_TUNE_RUN_RESTARTS times."""
        me = ray.get_runtime_context().current_actor
        restarts = 0
        try:
            while True:
                try:
                    _await_sweeping(runner.fit.remote(self.study, name, configs, concurrency, me))
                    return
                except ray.exceptions.RayActorError as e:
                    restarts += 1
                    if restarts > MAX_TUNE_RUN_RESTARTS:
                        raise
                    configs = self._not_done(configs)
                    self.console.say(
                        f"round {name}: its Tune run's process died ({type(e).__name__}); starting "
                        f"{trial_count(len(configs))} not done again, from their checkpoints"
                    )
                    remove_placement_groups_of(runner)
                    runner = tune_runner()
        finally:
            ray.kill(runner)
            remove_placement_groups_of(runner)

    def _not_done(self, configs: list[dict]) -> list[dict]:
        """The trial configs whose rows are not over (finished or diverged) in the table."""
        return [c for c in configs if self.table.rows[c["trial_name"]].get("status") not in DONE]

    def trial_event(self, kind: str, trial: dict, *args) -> None:
        """A Tune trial event from the running `TuneRun` (started, result, complete, error)."""
        if self.state == "stopped":  # a trial's last words as its study ends: it stays STOPPED
            return
        if trial["trial_name"] not in self.table.rows:  # planned by a bayesian round's searcher
            self.table.update(
                trial["trial_name"],
                round=trial["round"],
                status=TrialStatus.PENDING,
                max_train_steps=trial["max_train_steps"],
                **row_fields(trial),
            )
        if kind == "stopped":  # its storage is full (`launch.final_error_of`)
            kind, error = "error", args[0]
            self.storage_full = StorageFull(f"trial {trial['trial_name']}: {error}").advised()
        getattr(self.events, kind)(trial, *args)

    def console_lines(self, since: int) -> tuple[int, list[str], dict[str, dict]]:
        """The study's lines for its user from number `since` on, the next number
        (`ConsoleLines.since`) and the running trials' progress: `run_study` shows them in the
        command that started the study."""
        return (*self.console.since(since), self.console.running())

    def _concurrency(self, rnd: Round) -> int:
        return rnd.max_concurrent_trials or trials_that_fit(self.study, ray.cluster_resources())

    def settle_metrics(self) -> None:
        """Return once Ray has exported the study's last metric values (its final counts), so
        that they reach Prometheus before this actor goes."""
        time.sleep(self.observers.metrics.exported_in_s())

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


def trials_that_fit(study: Study, resources: dict) -> int:
    """How many of the study's trials the cluster's `resources` (`ray.cluster_resources()`) hold
    at once, each counted with all it holds (`checks.trial_footprint`); at least 1."""
    need = trial_footprint(study)
    # A hair over the quotient: 0.9 CPU / 0.3 is 2.9999999999999996 in floating point.
    fits = [math.floor(resources.get(name, 0) / amount + 1e-9) for name, amount in need.items() if amount]
    return max(1, min(fits, default=1))


def _await_sweeping(run: ray.ObjectRef):
    """What a TuneRun's fit returns, removing what dead actors of this job hold meanwhile: a
    trial's process killed while its Ray Train controller starts the worker group leaves that
    group's CPUs held, and the restarted trial would wait for them forever (found by
    `make chaos`). Done here, not in the TuneRun's process beside Tune's loop."""
    while not ray.wait([run], timeout=ORPHAN_SWEEP_S)[0]:
        remove_orphaned_placement_groups()
    return ray.get(run)


def tune_runner():
    """A new `TuneRun` actor, on this (the coordinator's) node."""
    return TuneRun.options(scheduling_strategy=on_this_node()).remote()
