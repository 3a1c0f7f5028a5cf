"""The Grafana dashboard's queries on a real Prometheus: Debian's `prometheus`, configured from
deploy/prometheus/prometheus.yml, finds a `ray start --head` through Ray's service-discovery
file while `playbook run` runs a real 3-trial grid study on it (one trial diverges, one has its
process killed once and resumes), and every query of deploy/grafana/playbook-study.json, its
variables filled in, answers what the study's own records say: the trial table (states, best
metric), the trials' metrics logs (steps, steps/s, evaluation and checkpoint times, exposed input
fraction) and their attempt records (restarts). A finished trial's series leave Prometheus while
the study still runs (Ray drops a gauge not re-sent for two export intervals)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from service.study.layout import StudyLayout
from tests.helpers.prometheus import start_prometheus
from tests.helpers.ray_head import new_temp_dir, start_ray_head
from tests.helpers.studies import study_dict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "playbook-study.json"
STUDY, ROUND, STEPS, EVERY = "watched", "g", 6000, 1000
TTL_WAIT_S = 5.0  # past Ray's gauge TTL (2 x the 1 s export interval) and a 1 s scrape
METRIC_RE = re.compile(r"ray_playbook_\w+")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> set[str]:
    return {t["expr"] for p in dashboard()["panels"] for t in p["targets"]}


def variable_series(name: str) -> str:
    """The series selector of the dashboard's `label_values(SELECTOR, name)` variable `name`."""
    (var,) = [v for v in dashboard()["templating"]["list"] if v["name"] == name]
    return re.fullmatch(rf"label_values\((.*), {name}\)", var["query"]["query"]).group(1)


def fill(expr: str, trial: str = ".*") -> str:
    """The query as Grafana sends it with study and round chosen and every trial ("All")."""
    return expr.replace("$study", STUDY).replace("$round", ROUND).replace("$trial", trial)


def key(expr: str) -> tuple[str, ...]:
    """A query's metrics without their prefix: what the test checks it against."""
    return tuple(m.removeprefix("ray_playbook_") for m in METRIC_RE.findall(expr))


def grid_study(digits_dir, storage) -> dict:
    d = study_dict(
        digits_dir, storage, name=STUDY, training={"max_train_steps": STEPS, "eval_every_steps": EVERY}
    )
    d["search"] = {  # g-0000 diverges at its first evaluation
        "learning_rate": {"role": "nuisance", "type": "choice", "values": [1e30, 0.05, 0.1]},
        "momentum": {"role": "fixed", "value": 0.9},
        "width": {"role": "fixed", "value": 4},
    }
    d["rounds"] = [{"name": ROUND, "kind": "grid", "num_trials": 3}]
    return d


class Watch:
    """What the test saw while the study ran."""

    def __init__(self, layout: StudyLayout, out_path: Path):
        self.layout, self.out_path = layout, out_path
        self.step_samples: dict[str, list[float]] = {}  # trial -> instant trial_step values
        self.trial_variable: set[str] = set()
        self.killed_pid: int | None = None
        self.done_at: float | None = None  # when g-0000's "diverged" line appeared
        self.gone_after_done: bool | None = None

    def poll(self, prom, exprs: set[str]) -> None:
        (step_expr,) = [e for e in exprs if key(e) == ("trial_step",)]
        for s in prom.query(fill(step_expr)):
            self.step_samples.setdefault(s["metric"]["trial"], []).append(float(s["value"][1]))
        self.trial_variable |= set(prom.label_values("trial", fill(variable_series("trial"))))
        self.kill_once("g-0001")
        self.check_gone(prom, "g-0000")

    def kill_once(self, trial: str) -> None:
        """The trial's process, killed once after its first evaluation: Tune restarts it and it
        resumes from its checkpoint, a second attempt."""
        t = self.layout.trial(trial)
        if self.killed_pid is None and os.path.exists(t.metrics_log):
            self.killed_pid = json.loads(Path(t.attempt).read_text())["pid"]
            os.kill(self.killed_pid, signal.SIGKILL)

    def check_gone(self, prom, trial: str) -> None:
        if self.done_at is None and f"[{trial}] diverged" in self.out_path.read_text():
            self.done_at = time.time()
        if self.gone_after_done is None and self.done_at and time.time() > self.done_at + TTL_WAIT_S:
            series = prom.query(f'ray_playbook_trial_step{{study="{STUDY}", trial="{trial}"}}')
            self.gone_after_done = series == []


def test_every_panel_query_answers_what_the_study_recorded(digits_dir, tmp_path):
    exprs = dashboard_exprs()
    temp_dir = new_temp_dir()
    storage = tmp_path / "storage"
    (study_file := tmp_path / "study.yaml").write_text(yaml.safe_dump(grid_study(digits_dir, storage)))
    layout = StudyLayout.of(str(storage), STUDY)
    fast_export = {"RAY_metrics_report_interval_ms": "1000"}
    with (
        start_ray_head(tmp_path, fast_export, temp_dir) as (_, gcs, env),
        start_prometheus(tmp_path, temp_dir) as prom,
    ):
        start = time.time()
        out_path = tmp_path / "run.out"
        with open(out_path, "w") as out:
            run = subprocess.Popen(
                [sys.executable, "-m", "service", "run", str(study_file)],
                env={**env, "RAY_ADDRESS": gcs},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            watch = Watch(layout, out_path)
            try:
                while run.poll() is None and time.time() < start + 300:
                    watch.poll(prom, exprs)
                    time.sleep(0.5)
            finally:
                if run.poll() is None:
                    os.kill(run.pid, signal.SIGKILL)
                run.wait(timeout=60)
        assert run.returncode == 0, out_path.read_text()[-4000:]
        time.sleep(2)  # the last scrape of the last values
        ranges = {e: prom.query_range(fill(e), start, time.time()) for e in exprs}
        studies = prom.label_values("study", variable_series("study"))
        rounds = prom.label_values("round", fill(variable_series("round")))

    rows = {r["trial_name"]: r for r in pq.read_table(layout.trials_parquet).to_pylist()}
    logs = {name: read_log(layout, name) for name in rows}
    attempts = {name: json.loads(Path(layout.trial(name).attempt).read_text())["attempt"] for name in rows}

    # the variables list the study, its round and (while they ran) its trials
    assert STUDY in studies and rounds == [ROUND]
    assert watch.trial_variable == set(rows), watch.trial_variable
    # a trial's series leave once it is done, while the study still runs
    assert watch.done_at is not None and watch.gone_after_done is True, (watch.done_at, watch.gone_after_done)
    # steps of the running trials, sampled while they ran, are steps of their metrics logs
    assert set(watch.step_samples) == set(rows)
    for name, samples in watch.step_samples.items():
        assert set(samples) <= {0.0} | {float(r["step"]) for r in logs[name]}, name
    assert any(0 < v < STEPS for v in watch.step_samples["g-0001"])

    checked = set()
    for expr, series in ranges.items():
        CHECKS[key(expr)](series, rows, logs, attempts)
        checked.add(key(expr))
    # the dashboard's queries are exactly the ones checked here
    assert checked == set(CHECKS), set(CHECKS) - checked


def read_log(layout: StudyLayout, trial: str) -> list[dict]:
    return [json.loads(line) for line in Path(layout.trial(trial).metrics_log).read_text().splitlines()]


def values(series: list[dict]) -> dict[tuple, list[float]]:
    """(study, round, trial) labels present -> the samples' values in time order."""
    return {
        tuple(s["metric"].get(k) for k in ("study", "round", "trial") if k in s["metric"]): [
            float(v) for _, v in s["values"]
        ]
        for s in series
    }


def study_max(series: list[dict]) -> float:
    (vals,) = values(series).values()
    return max(vals)


def count(state: str):
    def check(series, rows, logs, attempts):
        assert study_max(series) == sum(r["status"] == state for r in rows.values()), state

    return check


def check_pending(series, rows, logs, attempts):
    assert study_max(series) == len(rows)  # every trial is planned before the first starts


def check_running(series, rows, logs, attempts):
    assert 1 <= study_max(series) <= 2  # two CPUs, one per trial


def check_best(series, rows, logs, attempts):
    (vals,) = values(series).values()
    finished = [r["best_metric"] for r in rows.values() if r["status"] == "FINISHED"]
    assert vals[-1] == pytest.approx(float(np.min(finished)), rel=1e-12)
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))  # min mode: only goes down


def last_per_trial(series) -> dict[str, float]:
    return {labels[2]: vals[-1] for labels, vals in values(series).items()}


def last_row_with(log: list[dict], field: str, upto: float) -> dict | None:
    rows = [r for r in log if r["step"] <= upto and field in r]
    return rows[-1] if rows else None


def per_trial(field: str):
    """A running trial's last published value of `field` is the one its metrics log holds at the
    last step it published (the last row having the field: an evaluation's and a checkpoint's
    times are kept until the next one); a trial that never had one has no series."""

    def check(series, rows, logs, attempts):
        last = last_per_trial(series)
        for name, log in logs.items():
            row = last_row_with(log, field, log[-1]["step"])
            if row is None:
                assert name not in last, (field, name)
            else:
                assert last[name] == pytest.approx(row[field], rel=1e-12), (field, name)

    return check


def check_step(series, rows, logs, attempts):
    assert last_per_trial(series) == {name: float(log[-1]["step"]) for name, log in logs.items()}
    assert logs["g-0000"][-1]["status"] == "diverged" and rows["g-0000"]["status"] == "DIVERGED"


def check_total(series, rows, logs, attempts):
    assert last_per_trial(series) == {name: float(r["max_train_steps"]) for name, r in rows.items()}


def check_progress(series, rows, logs, attempts):
    assert last_per_trial(series) == pytest.approx(
        {name: log[-1]["step"] / rows[name]["max_train_steps"] for name, log in logs.items()}
    )


def restarts(attempts) -> int:
    return sum(a - 1 for a in attempts.values())


def check_restarts(series, rows, logs, attempts):
    assert restarts(attempts) == 1  # the killed g-0001
    assert list(values(series)) == [(STUDY, ROUND)]
    assert study_max(series) == restarts(attempts)


def check_failed_attempts(series, rows, logs, attempts):
    failed = sum(r["status"] == "FAILED" for r in rows.values())
    assert study_max(series) == restarts(attempts) + failed


CHECKS = {
    ("trials_pending",): check_pending,
    ("trials_running",): check_running,
    ("trials_finished",): count("FINISHED"),
    ("trials_diverged",): count("DIVERGED"),
    ("trials_failed",): count("FAILED"),
    ("best_metric",): check_best,
    ("trial_steps_per_s",): per_trial("steps_per_s"),
    ("trial_step", "trial_total_steps"): check_progress,
    ("trial_step",): check_step,
    ("trial_total_steps",): check_total,
    ("trial_eval_s",): per_trial("eval_s"),
    ("trial_checkpoint_s",): per_trial("checkpoint_s"),
    ("trial_exposed_input_fraction",): per_trial("input/exposed_fraction"),
    ("worker_group_restarts",): check_restarts,
    ("failed_attempts",): check_failed_attempts,
}
