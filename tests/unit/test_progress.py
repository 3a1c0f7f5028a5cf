"""Live progress lines: at most one per trial per interval (plus first and last), the ETA from
the reported rate, and the line's fields; the lines the coordinator keeps for the command that
started the study, and the line each trial event says."""

from __future__ import annotations

import io
import json

from service.cli.live_table import LiveTable, table_lines
from service.tracking.console import ConsoleLines
from service.tracking.progress import ProgressLimiter, eta_s, format_duration, progress_line
from service.tracking.trial_events import TrialEvents
from service.tracking.trial_table import TrialTable


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_at_most_one_line_per_trial_per_interval():
    clock = FakeClock()
    limiter = ProgressLimiter(10.0, clock)
    printed = []
    # two trials reporting every second for 35 s, 1 step per second, 100 steps
    for t in range(36):
        clock.now = float(t)
        for trial in ("a", "b"):
            if limiter.should_print(trial, t, 100):
                printed.append((trial, t))
    # independent expectation: first report, then every 10 s, per trial
    assert printed == [(trial, t) for t in (0, 10, 20, 30) for trial in ("a", "b")]
    clock.now = 31.0
    assert limiter.should_print("a", 100, 100)  # the last step is always printed
    assert not limiter.should_print("a", 99, 100)


def test_eta_and_line():
    assert eta_s(40, 100, 12.0) == 5.0
    assert eta_s(40, 100, None) is None and eta_s(40, 100, 0.0) is None
    assert [format_duration(s) for s in (5, 65, 3725, None)] == ["5s", "1m05s", "1h02m", "?"]
    result = {"step": 40, "train/loss": 0.5, "validation/loss": 0.25, "steps_per_s": 3.0}
    result |= {"best_metric": 0.25, "best_step": 40}
    line = progress_line("explore-0001", result, 100, "validation/loss")
    assert line.startswith("[explore-0001] step 40/100 (40%) ")
    for part in ("train/loss=0.5", "validation/loss=0.25", "best=0.25 at 40", "3 steps/s", "ETA 20s"):
        assert part in line


def test_console_lines_are_fetched_in_order_and_a_slow_reader_is_told_what_it_missed():
    console = ConsoleLines(keep=3)
    for i in range(2):
        console.say(f"line {i}")
    assert console.since(0) == (2, ["line 0", "line 1"])
    assert console.since(2) == (2, [])
    for i in range(2, 6):
        console.say(f"line {i}")
    # lines 0-5 said, 3-5 kept: a reader at 2 missed line 2, one at 4 gets 4 and 5
    assert console.since(2) == (6, ["(1 earlier lines were not kept)", "line 3", "line 4", "line 5"])
    assert console.since(4) == (6, ["line 4", "line 5"])


def test_trial_events_say_one_line_per_event_and_keep_the_running_trials_progress(tmp_path):
    console = ConsoleLines()
    table = TrialTable(str(tmp_path / "study"), "validation/loss", "min")
    events = TrialEvents(table, None, "validation/loss", console)
    trial = {"trial_name": "explore-0000", "round": "explore", "max_train_steps": 100}
    trial["hparams"] = {"learning_rate": 0.1}
    table.update("explore-0000", round="explore", status="PENDING", max_train_steps=100)
    events.started(trial)
    assert console.running() == {"explore-0000": {"round": "explore", "step": 0, "total": 100}}
    report = {"step": 40, "validation/loss": 0.5, "best_metric": 0.25, "best_step": 20, "steps_per_s": 3.0}
    events.result(trial, report)
    assert console.running()["explore-0000"] == {
        "round": "explore",
        "step": 40,
        "total": 100,
        "metric": 0.5,
        "best": 0.25,
        "steps_per_s": 3.0,
    }
    events.started(trial)  # Tune started it again after its process died: it resumes
    assert console.running()["explore-0000"]["step"] == 40
    summary = {"summary": True, "status": "diverged", "last_step": 60, "validation/loss": 0.25}
    events.result(trial, {**summary, "best_step": 20, "diverged_at_step": 60})
    assert console.running() == {}  # over: no longer running
    said = console.since(0)[1]
    assert said[0] == "[explore-0000] started: 100 steps, learning_rate=0.1"
    assert said[1].startswith("[explore-0000] step 40/100 (40%) ")
    assert said[2:] == [
        "[explore-0000] resumed from its latest checkpoint (step 40/100 reached before)",
        "[explore-0000] diverged at step 60: best validation/loss=0.25 at step 20",
    ]
    events.error({"trial_name": "explore-0001", "max_train_steps": 100}, "ValueError: bad (all of it: x)")
    assert console.since(4)[1] == ["[explore-0001] FAILED: ValueError: bad (all of it: x)"]


def test_a_trial_started_again_after_its_command_was_killed_says_the_step_its_log_reached(tmp_path):
    """The command SIGKILLed: the table was last saved when the trial started (RUNNING, no step),
    its metrics log has its evaluations up to step 60. The rerun says it resumes, from the log;
    a trial that never ran says it starts, whatever files lie about."""
    console = ConsoleLines()
    table = TrialTable(str(tmp_path / "study"), "validation/loss", "min")
    events = TrialEvents(table, None, "validation/loss", console)
    for name in ("explore-0000", "explore-0001"):
        log = tmp_path / "study" / "trials" / name / "metrics.jsonl"
        log.parent.mkdir(parents=True)
        lines = [json.dumps({"step": s, "validation/loss": 1 / s}) for s in (20, 40, 60)]
        log.write_text("".join(line + "\n" for line in lines))
    table.update("explore-0000", round="explore", status="RUNNING", max_train_steps=100)
    table.update("explore-0001", round="explore", status="PENDING", max_train_steps=100)
    for name in ("explore-0000", "explore-0001"):
        events.started({"trial_name": name, "round": "explore", "max_train_steps": 100, "hparams": {}})
    assert console.since(0)[1] == [
        "[explore-0000] resumed from its latest checkpoint (step 60/100 reached before)",
        "[explore-0001] started: 100 steps",
    ]
    assert console.running()["explore-0000"]["step"] == 60 and table.rows["explore-0000"]["step"] == 60


def test_the_live_table_of_running_trials():
    trials = {
        "explore-0001": {"round": "explore", "step": 40, "total": 100, "metric": 0.5, "best": 0.25},
        "explore-0000": {"round": "explore", "step": 0, "total": 100},
    }
    trials["explore-0001"]["steps_per_s"] = 3.0  # 60 steps left: 20 s
    assert table_lines(trials, "validation/loss") == [
        "trial         round    step    validation/loss  best  ETA",
        "explore-0000  explore  0/100   -                -     ?",
        "explore-0001  explore  40/100  0.5              0.25  20s",
    ]
    assert table_lines({}, "validation/loss") == []


def test_the_live_table_is_erased_before_each_line_and_drawn_again_below_it():
    out = io.StringIO()
    view = LiveTable("loss", out)
    view.say("round r: 1 trials")  # nothing running: no table
    view.running({"r-0000": {"round": "r", "step": 0, "total": 10}})  # header + 1 row
    view.say("[r-0000] started")
    view.running({})  # over: the table goes
    table = "trial   round  step  loss  best  ETA\nr-0000  r      0/10  -     -     ?\n"
    erase = "\x1b[2F\x1b[J"  # 2 lines up, erased to the end of the screen
    assert out.getvalue() == "round r: 1 trials\n" + table + erase + "[r-0000] started\n" + table + erase


def test_a_finished_trials_plateau_is_judged_where_it_began(tmp_path):
    """A finished trial's step verdict is judged where its best value was first reached (its
    summary's `reached_best_step`): a plateau from step 100 to the end (160) is not "train
    longer"; a best reached at the end is. The started line lists hyperparameters by name."""
    table = TrialTable(str(tmp_path / "study"), "validation/error", "min")
    events = TrialEvents(table, None, "validation/error", ConsoleLines())
    for name, reached in (("plateau", 100), ("late", 160)):
        table.update(name, round="r", status="PENDING", max_train_steps=160)
        trial = {"trial_name": name, "round": "r", "max_train_steps": 160, "hparams": {"w": 1, "lr": 0.1}}
        events.started(trial)
        summary = {"summary": True, "status": "finished", "last_step": 160, "validation/error": 0.037}
        events.result(trial, {**summary, "best_step": 160, "reached_best_step": reached})
    verdicts = {name: row.get("step_verdict") for name, row in table.rows.items()}
    assert verdicts["plateau"] == "ok"
    assert "is at step 160 of 160" in verdicts["late"] and "train longer" in verdicts["late"]
    assert events.console.since(0)[1][0] == "[plateau] started: 160 steps, lr=0.1 w=1"
