"""Chaos runs: a small study, run by `playbook run` on an embedded Ray as a user runs it, with one
of its processes SIGKILLed at a random moment; the user's rerun (only where the command died or
failed) must end bitwise equal to the uninterrupted reference.

Three studies, run alike: `solo` (one-worker trials: the Tune trial's process trains), `pair`
(two-worker trials on reused workers, the default: the Tune trial's process and a pool actor)
and `trainpair` (the same as a Ray Train run per trial, `reuse_workers: false`: a Ray Train
controller and two training workers), each with a local input worker process per rank
(`input.workers: processes`). Every run draws, from its own seed, a
process class (uniformly from CLASSES), a study that has it, and a moment: uniform over the time
processes of that class lived in the reference run, named by which of them (the nth of the class
to come up) and how long after it came up, so that a run slower or faster than the reference
kills in the same part of the study. That process is SIGKILLed then (gone by then: the next one
of the class alive). The results compared with the reference: the trial table (minus its timing columns,
a checkpoint by its step), each trial's metrics log (minus timings), and every kept checkpoint
(the same steps; model, optimizer, every rank's RNG, history without timings, equal tensor for
tensor). After each command no process of its session nor its reaper may be left.

`python -m tests.helpers.chaos --runs N [--seed S] [--only CLASS] [--no-doc]`: run i uses seed
S + i, so `--seed S+i --runs 1` replays it. Without `--only` and `--no-doc` the figure and the
table of runs are written into docs/reliability.md (the generated block between the markers),
after every run, so that an interrupted `make chaos` leaves the figure of the runs it did."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq
import yaml

from service.distributed import checkpoint
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.playbook_process import output, start_run, titles, watchers_of
from tests.helpers.processes import kill_session, session_pids
from tests.helpers.reliability_counts import DOC, rewrite_doc
from tests.helpers.studies import TRIAL_LAYOUTS, same_nested, study_dict

BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"
CLASSES = (
    "driver",
    "coordinator",
    "tune_run",
    "trial",
    "pool_worker",
    "train_controller",
    "train_worker",
    "input_worker",
)
TITLES = {
    "coordinator": "ray::Coordinator",
    "tune_run": "ray::TuneRun",
    "trial": "ray::ImplicitFunc",
    "pool_worker": "ray::PoolWorker",
    "train_controller": "ray::TrainController",
    "train_worker": "ray::RayTrainWorker",
}
STUDY_LAYOUTS = {"solo": "fast-path", "pair": "pool", "trainpair": "ray-train"}
"""Each study's trial layout (`studies.TRIAL_LAYOUTS`)."""
STUDIES = tuple(STUDY_LAYOUTS)
ONLY_IN = {"pool_worker": "pair", "train_controller": "trainpair", "train_worker": "trainpair"}
"""The study that has a class of processes that not every study has."""
SELF_HEALING = ("tune_run", "trial", "pool_worker", "train_controller", "train_worker", "input_worker")
"""Classes whose loss the service recovers from by itself: `playbook run` should exit 0."""
STEPS, EVERY = 600, 100
TABLE_TIMINGS = ("updated_at", "input/exposed_fraction", "input/verdict", "input/bound")
"""Trial-table columns measured on the wall clock (the input verdict and bound are read from
the exposed fraction)."""
COMMAND_TIMEOUT_S = 900  # a command still running then is a hang, and the run's outcome
POLL_S = 0.1  # how often a run's processes are listed
LATEST = 0.8  # a process is killed within the first this-much of its life in the reference
GONE_WITHIN_S = 30  # after a command ends, its session's processes and its reaper must be gone


def study_raw(name: str, digits_dir: str, storage: str) -> dict:
    """One of STUDIES: two trials, one at a time, a checkpoint every EVERY steps."""
    return study_dict(
        _Path(digits_dir),
        storage,
        name=f"chaos-{name}",
        scaling=TRIAL_LAYOUTS[STUDY_LAYOUTS[name]],
        input={"workers": "processes", "num_input_workers": 1},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "schedule": {"kind": "constant"}},
        search={
            "learning_rate": {"role": "nuisance", "type": "choice", "values": [0.05, 0.1]},
            "momentum": {"role": "fixed", "value": 0.9},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[{"name": "explore", "kind": "grid", "num_trials": 2, "max_concurrent_trials": 1}],
    )


class _Path(str):
    """A folder path that `study_dict` can join with `/` (it takes pytest's Path)."""

    def __truediv__(self, other: str) -> str:
        return os.path.join(self, other)


def write_study(name: str, digits_dir: str, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "study.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(study_raw(name, digits_dir, os.path.join(folder, "storage")), f)
    return path


def study_uri(name: str, folder: str) -> str:
    return os.path.join(folder, "storage", f"chaos-{name}")


# -- the processes of a run ------------------------------------------------------------------


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def processes(driver_pid: int) -> dict[str, list[int]]:
    """The study's processes by class, each list oldest first (by pid): the command itself, the
    Ray actors by their titles, and the input workers (the children of an input fork server,
    not the server)."""
    found = {c: [] for c in CLASSES}
    found["driver"].append(driver_pid)
    cmds = titles(driver_pid)
    for pid, cmd in sorted(cmds.items()):
        for cls, title in TITLES.items():
            if cmd.startswith(title):
                found[cls].append(pid)
        if _is_input_server(cmd) and _is_input_server(cmds.get(_parent(pid), "")):
            found["input_worker"].append(pid)
    return found


def _is_input_server(cmd: str) -> bool:
    return "multiprocessing.forkserver" in cmd and "service.data.process_input" in cmd


def observe(proc) -> dict[str, list[tuple[float, float]]]:
    """Until `proc` ends: per class, each of its processes in the order they came up, as the
    (first, last) moment it was seen alive, in seconds from now."""
    t0, lives = time.time(), {c: {} for c in CLASSES}
    while proc.poll() is None:
        now = time.time() - t0
        for cls, pids in processes(proc.pid).items():
            for pid in pids:
                lives[cls].setdefault(pid, [now, now])[1] = now
        time.sleep(POLL_S)
    return {cls: [tuple(life) for life in by_pid.values()] for cls, by_pid in lives.items() if by_pid}


def finish(proc, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int | None, list[str]]:
    """(exit code, or None if it hung and was killed; what was left of its session and its
    reaper GONE_WITHIN_S after it ended, each killed by pid)."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # a hang
        rc = None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + GONE_WITHIN_S
    while (session_pids(proc.pid) or watchers_of(proc.pid)) and time.time() < deadline:
        time.sleep(0.5)
    left = sorted(set(titles(proc.pid).values()))
    watchers = watchers_of(proc.pid)
    left += [f"reaper pid {pid}" for pid in watchers]
    kill_session(proc.pid)
    for pid in watchers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rc, left


# -- results ---------------------------------------------------------------------------------


def trial_rows(uri: str) -> list[dict]:
    rows = pq.read_table(os.path.join(uri, "trials.parquet")).to_pylist()
    out = []
    for row in sorted(rows, key=lambda r: r["trial_name"]):
        row = {k: v for k, v in row.items() if k not in TABLE_TIMINGS}
        if row.get("best_checkpoint"):
            row["best_checkpoint"] = checkpoint.step_of(row["best_checkpoint"])
        out.append(row)
    return out


def metrics_log(trial_dir: str) -> list[str]:
    with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
        return [_untimed(json.loads(line)) for line in f if line.strip()]


def _untimed(metrics: dict) -> str:
    """`metrics` less its wall-clock fields, as canonical JSON: equal floats print alike (repr
    round-trips), and so do two NaNs (a class never predicted has a NaN precision)."""
    return json.dumps({k: v for k, v in metrics.items() if k not in TIMING_FIELDS}, sort_keys=True)


def _same(a, b) -> bool:
    """Equal values, NaN equal to NaN (a diverged trial's metric)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def kept_checkpoints(trial_dir: str) -> dict[int, str]:
    dirs = [os.path.join(trial_dir, d) for d in os.listdir(trial_dir) if d.startswith("checkpoint_")]
    return {checkpoint.step_of(d): d for d in dirs if checkpoint.is_complete(d)}


def differences(got_uri: str, want_uri: str) -> list[str]:
    """What differs between a run's results and the reference's (empty: bitwise equal)."""
    try:
        got_rows = trial_rows(got_uri)
    except OSError as e:
        return [f"no trial table: {e}"]
    want_rows = trial_rows(want_uri)
    diffs = []
    if [r["trial_name"] for r in got_rows] != [r["trial_name"] for r in want_rows]:
        return [f"trials {[r['trial_name'] for r in got_rows]} != {[r['trial_name'] for r in want_rows]}"]
    for got, want in zip(got_rows, want_rows, strict=True):
        name = want["trial_name"]
        diffs += [
            f"{name}: table {k} {got.get(k)!r} != {want.get(k)!r}" for k in want if got.get(k) != want.get(k)
        ]
        got_dir, want_dir = (os.path.join(u, "trials", name) for u in (got_uri, want_uri))
        if metrics_log(got_dir) != metrics_log(want_dir):
            diffs.append(f"{name}: metrics log differs")
        diffs += _checkpoint_differences(name, kept_checkpoints(got_dir), kept_checkpoints(want_dir))
    return diffs


def _checkpoint_differences(name: str, got: dict[int, str], want: dict[int, str]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"{name}: kept checkpoints at steps {sorted(got)} != {sorted(want)}"]
    diffs = []
    for step in sorted(want):
        a, b = checkpoint.load(got[step]), checkpoint.load(want[step])
        for part in ("step", "model", "optimizer", "rng_states", "hparams", "scaler"):
            if not same_nested(getattr(a, part), getattr(b, part)):
                diffs.append(f"{name}: checkpoint at step {step}: {part} differs")
        if [_untimed(h) for h in a.history] != [_untimed(h) for h in b.history]:
            diffs.append(f"{name}: checkpoint at step {step}: history differs")
    return diffs


# -- runs ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Reference:
    uri: str
    lives: dict[str, list[tuple[float, float]]]
    duration_s: float


def run_reference(name: str, digits_dir: str, folder: str) -> Reference:
    """The study uninterrupted, watched for when each class of process lives."""
    study_file = write_study(name, digits_dir, folder)
    t0 = time.time()
    proc = start_run(study_file, folder)
    lives = observe(proc)
    rc, left = finish(proc)
    if rc != 0 or left:
        raise RuntimeError(f"the {name} reference run failed (exit {rc}, left {left}): {output(folder)}")
    return Reference(study_uri(name, folder), lives, time.time() - t0)


@dataclasses.dataclass
class Draw:
    seed: int
    cls: str
    study: str
    nth: int
    """The process killed: the nth of its class to come up (from 0)..."""
    delay_s: float
    """... this long after it came up (the next one of the class, if it is gone by then)."""
    moment_s: float
    """When that was in the reference run."""
    anchor_s: float
    """When the run's pace is taken: the reference's moment the killed process came up (the
    command's: its coordinator); the delay is scaled by how much later or sooner the run got there."""

    @property
    def moment(self) -> str:
        return (
            f"process {self.nth + 1} of its class, {self.delay_s} s after it came up ({self.moment_s} s in)"
        )


def draw(seed: int, references: dict[str, Reference], only: str | None = None) -> Draw:
    """A run's class, study and moment, from its seed alone: a moment uniform over the time
    processes of the class lived in the reference (each within its first LATEST), named by
    which of them it fell in and how long after it came up, so that a run slower or faster
    than the reference still kills in the same part of the study."""
    rng = random.Random(seed)
    cls, study = _class_and_study(rng, only)
    lives = references[study].lives[cls]
    spans = [last - first + POLL_S for first, last in lives]
    at = rng.random() * sum(spans)
    nth = 0
    while at >= spans[nth] and nth < len(spans) - 1:
        at, nth = at - spans[nth], nth + 1
    delay = round(min(at, spans[nth]) * LATEST, 1)
    anchor = references[study].lives["coordinator"][0][0] if cls == "driver" else lives[nth][0]
    return Draw(seed, cls, study, nth, delay, round(lives[nth][0] + delay, 1), anchor)


def draw_study(seed: int, only: str | None = None) -> str:
    """The study that run `seed` uses (what `draw` draws first, before it needs references)."""
    return _class_and_study(random.Random(seed), only)[1]


def _class_and_study(rng: random.Random, only: str | None) -> tuple[str, str]:
    cls = only or rng.choice(CLASSES)
    return cls, ONLY_IN.get(cls) or rng.choice(STUDIES)


@dataclasses.dataclass
class Outcome:
    draw: Draw
    killed: str  # "pid N (title) at T s", or why nothing was killed
    exit_code: int | None
    rerun_exit_code: int | None  # None: no rerun was needed (or it hung)
    reran: bool
    differences: list[str]
    left: list[str]
    duration_s: float

    @property
    def killed_one(self) -> bool:
        return self.killed.startswith("pid")

    @property
    def equal(self) -> bool:
        return self.killed_one and not self.differences and not self.left

    @property
    def verdict(self) -> str:
        if not self.killed_one:
            return "no kill"
        problems = self.differences + [f"left running: {p}" for p in self.left]
        if problems:
            return "; ".join(problems)
        return "equal after the rerun" if self.reran else "equal"

    def line(self) -> str:
        d = self.draw
        rerun = f", rerun exit {self.rerun_exit_code}" if self.reran else ", no rerun"
        return (
            f"seed {d.seed}: {d.cls} of {d.study}, {d.moment}: killed {self.killed}; "
            f"exit {self.exit_code}{rerun}; {self.verdict} ({self.duration_s:.0f} s)"
        )


def chaos_run(d: Draw, digits_dir: str, folder: str, reference: Reference) -> Outcome:
    """One run: the study started, one process of `d.cls` SIGKILLed at `d.moment_s`, the
    command rerun where it died or failed, the results compared with the reference."""
    t0 = time.time()
    study_file = write_study(d.study, digits_dir, folder)
    proc = start_run(study_file, folder)
    killed = kill_at(proc, d, t0)
    rc, left = finish(proc)
    rerun_rc, reran = None, rc != 0
    if reran:
        shutil.copy(os.path.join(folder, "err.txt"), os.path.join(folder, "err-first.txt"))
        rerun = start_run(study_file, folder)
        rerun_rc, rerun_left = finish(rerun)
        left += rerun_left
    done = rc == 0 or rerun_rc == 0
    diffs = differences(study_uri(d.study, folder), reference.uri) if done else ["the rerun failed or hung"]
    return Outcome(d, killed, rc, rerun_rc, reran, diffs, left, time.time() - t0)


def kill_at(proc, d: Draw, t0: float) -> str:
    """SIGKILL the `d.nth` process of class `d.cls` to come up, `d.delay_s` after it came up
    (or, gone by then, the next one of the class alive); what was killed, or why nothing was."""
    seen: dict[str, dict[int, float]] = {d.cls: {}, "coordinator": {}}  # pid -> when it came up
    due = None
    while proc.poll() is None:
        now, found = time.time() - t0, processes(proc.pid)
        for cls, came_up in seen.items():
            for pid in found[cls]:
                came_up.setdefault(pid, now)
        due = due if due is not None else _due(d, seen)
        alive = found[d.cls]
        later = [pid for pid in list(seen[d.cls])[d.nth :] if pid in alive]
        if due is not None and time.time() - t0 >= due and later:
            pid = later[0]
            title = {"driver": "playbook run", "input_worker": "input worker"}.get(d.cls)
            title = title or titles(proc.pid).get(pid, "?").split(" ")[0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return f"pid {pid} ({title}) at {time.time() - t0:.1f} s"
        time.sleep(POLL_S)
    return f"nothing: the command ended (exit {proc.returncode}) before {d.moment}"


def _due(d: Draw, seen: dict[str, dict[int, float]]) -> float | None:
    """When (seconds after the start) to kill, once the run has reached the draw's anchor: the
    delay scaled by the run's pace against the reference's (within a factor of 4 either way)."""
    if d.cls == "driver":
        if d.delay_s <= d.anchor_s:  # while Ray starts: no pace to take yet
            return d.delay_s
        anchor = next(iter(seen["coordinator"].values()), None)
        came_up = 0.0
    else:
        times = list(seen[d.cls].values())
        anchor = came_up = times[d.nth] if len(times) > d.nth else None
    if anchor is None:
        return None
    pace = min(max(anchor / d.anchor_s, 0.25), 4.0) if d.anchor_s >= 1 else 1.0
    return came_up + d.delay_s * pace


# -- the command -----------------------------------------------------------------------------


def summary_lines(outcomes: list[Outcome], started: str, duration_s: float, planned: int) -> list[str]:
    equal = sum(o.equal for o in outcomes)
    healing = [o for o in outcomes if o.draw.cls in SELF_HEALING]
    so_far = "" if len(outcomes) == planned else f" (so far: {len(outcomes)} of {planned} runs)"
    lines = [
        f"Chaos runs: {equal}/{len(outcomes)} equal to the uninterrupted reference{so_far} "
        f"(`make chaos`, {started}, {duration_s / 60:.0f} min); of the {len(healing)} runs that "
        f"killed a process the service replaces by itself, {sum(not o.reran for o in healing)} "
        "needed no rerun.",
        "",
        "| seed | process killed | study | moment | killed | exit | rerun exit | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        d = o.draw
        rerun = str(o.rerun_exit_code) if o.reran else "no rerun"
        cells = (d.seed, d.cls, d.study, d.moment, o.killed, o.exit_code, rerun, o.verdict)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.helpers.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--seed", type=int, default=None, help="run i uses seed SEED + i (default: from the clock)"
    )
    parser.add_argument(
        "--only", choices=CLASSES, default=None, help="kill a process of this class in every run"
    )
    parser.add_argument(
        "--no-doc", action="store_true", help="do not rewrite docs/reliability.md's chaos block"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    work = tempfile.mkdtemp(prefix="chaos-")
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.time()
    print(f"chaos: {args.runs} runs from seed {seed} in {work}", flush=True)

    from service.data.builtin import write_digits

    digits = os.path.join(work, "digits")
    write_digits(digits)
    draws_needed = {draw_study(seed + i, args.only) for i in range(args.runs)}
    references = {}
    for name in sorted(draws_needed):
        references[name] = run_reference(name, digits, os.path.join(work, f"reference-{name}"))
        print(f"reference {name}: {references[name].duration_s:.0f} s", flush=True)
    outcomes, lines = [], []
    for i in range(args.runs):
        d = draw(seed + i, references, args.only)
        o = chaos_run(d, digits, os.path.join(work, f"run-{i:02d}"), references[d.study])
        outcomes.append(o)
        print(f"run {i + 1}/{args.runs}: {o.line()}", flush=True)
        lines = summary_lines(outcomes, started, time.time() - t0, args.runs)
        if not (args.only or args.no_doc):  # after every run: an interrupted one leaves its figure
            rewrite_doc(DOC, lines, BEGIN, END, fenced=False)
    print("\n".join(lines))
    if not (args.only or args.no_doc):
        print(f"wrote the chaos block of {os.path.relpath(DOC)}")
    if all(o.equal for o in outcomes):
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"kept {work} (each run's folder: out.txt, err.txt, err-first.txt, storage/)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
