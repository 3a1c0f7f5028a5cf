"""Input-wait instrumentation and the input-bound verdict: a workload with slow online
preprocessing is diagnosed, a fast one is not; the causes from the timings; the profiler trace."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service import workloads
from service.analysis.input_bound import InputTotals, input_bound, is_remote, trial_input_row
from service.analysis.report_lines import round_verdicts
from service.data.files import list_files
from service.data.loader import unused_columns
from service.data.sharding import RowRange
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import train
from tests.helpers import input_workloads


class Reporter:
    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def plan_for(digits_dir, storage, workload: str, **input_section) -> TrialPlan:
    study = spec.load_dict(
        {
            "name": "inp",
            "workload": workload,
            "data": {s: str(digits_dir / s) for s in ("train", "validation")},
            "storage": str(storage),
            "training": {"max_train_steps": 40, "batch_size": 32, "eval_every_steps": 20},
            "search": {
                "learning_rate": {"role": "fixed", "value": 0.1},
                "width": {"role": "fixed", "value": 4},
            },
            "rounds": [{"name": "r1", "num_trials": 1}],
            "input": input_section,
        }
    )
    return TrialPlan(study, "r1-0", "r1", {"learning_rate": 0.1, "width": 4})


def read_log(plan):
    with open(plan.metrics_uri) as f:
        return [json.loads(line) for line in f]


def run(plan) -> list[dict]:
    train(plan, Topology(), Reporter())
    return read_log(plan)


def compute_s_per_step(log: list[dict]) -> float:
    """The step time outside the wait for input, per step, of a run's last interval (past the
    first steps' warm-up): this machine's speed, now."""
    last, before = log[-1], log[-2]
    return (last["input/step_s"] - last["input/wait_s"]) / (last["step"] - before["step"])


def test_slow_preprocessing_is_input_bound_and_a_fast_workload_is_not(digits_dir, tmp_path, monkeypatch):
    fast = plan_for(digits_dir, tmp_path / "fast", "digits")
    fast_log = run(fast)
    # The slow workload's preprocessing (a sleep per example) takes 4 times the fast run's
    # compute per step, at least 1 ms and at most 10 ms per example: on a loaded machine, where
    # every step computes slower, a fixed sleep would hide behind the step and not be input-bound.
    s_per_row = min(max(input_workloads.SLOW_S_PER_ROW, 4 * compute_s_per_step(fast_log) / 32), 0.01)
    monkeypatch.setattr(input_workloads, "SLOW_S_PER_ROW", s_per_row)
    slow_name = f"{input_workloads.__name__}:SlowDigits"
    # Streamed every epoch (no cache): its preprocessing runs again for each window; a cached
    # shard is turned into tensors once, before the first step.
    slow = plan_for(digits_dir, tmp_path / "slow", slow_name, prefetch_batches=1, cache_mb=0)
    slow_log = run(slow)

    # Every eval row carries the interval's timings; the fraction is their ratio.
    for row in slow_log + fast_log:
        assert 0 <= row["input/wait_s"] <= row["input/step_s"]
        assert row["input/exposed_fraction"] == pytest.approx(row["input/wait_s"] / row["input/step_s"])
    # The slow workload spends at least its sleeps preprocessing.
    preprocess_s = sum(r["input/preprocess_s"] for r in slow_log)
    assert preprocess_s >= s_per_row * 39 * 32 * 0.9

    slow_row = trial_input_row("r1-0", slow_log, slow.study)
    fast_row = trial_input_row("r1-0", fast_log, fast.study)
    print(
        "exposed input fractions: slow",
        slow_row["input/exposed_fraction"],
        "fast",
        fast_row["input/exposed_fraction"],
    )
    assert slow_row["input/bound"] is True
    assert (
        "online preprocessing" in slow_row["input/verdict"]
        and "playbook preprocess" in slow_row["input/verdict"]
    )
    assert fast_row["input/bound"] is False
    assert slow_row["input/exposed_fraction"] > 0.2 > fast_row["input/exposed_fraction"]

    # The round's verdicts carry the warning for the input-bound trial only.
    rows = [
        {"trial_name": "r1-0", "round": "r1", "status": "FINISHED", **slow_row},
        {"trial_name": "r1-1", "round": "r1", "status": "FINISHED", **fast_row},
    ]
    found = [v for v in round_verdicts(slow.study, "r1", rows)["verdicts"] if v["kind"] == "input_bound"]
    assert [v["subject"] for v in found] == ["r1-0"]


def test_steps_per_s_leaves_out_the_wait_for_the_first_batch(digits_dir, tmp_path):
    """The loader's start-up (opening files, the first window) is not step time: a first batch
    late by `start_up_s` must not drag down the first interval's steps/s. The interval's time
    (20 / steps/s) is bracketed by when the source handed over its 1st and its 21st batch (the
    21st is asked for after the eval point that ends the interval): left out, the start-up
    cannot fit in it; counted, it would add start_up_s, longer than that eval point takes.
    Nothing here depends on how fast the machine is. start_up_s is 2 s, or 3 times the first
    interval of a run without the delay where that is longer (a loaded machine)."""
    calibration = plan_for(digits_dir, tmp_path / "calibration", "digits")
    start_up_s = max(2.0, 3 * 20 / run(calibration)[0]["steps_per_s"])
    handed = []

    def late_start(stream, start_step):
        time.sleep(start_up_s)  # a generator: runs at the first next(), inside the loop
        for batch in stream.iterate(start_step):
            handed.append(time.perf_counter())
            yield batch

    plan = plan_for(digits_dir, tmp_path / "late", "digits")
    train(plan, Topology(), Reporter(), batch_source=late_start)
    first = read_log(plan)[0]
    assert first["step"] == 20 and len(handed) > 20
    assert 20 / first["steps_per_s"] <= handed[20] - handed[0]


def totals(wait, step, read, pre, unused=()):
    return InputTotals(wait, step, read, pre, unused)


@pytest.mark.parametrize(
    "t, remote, cause",
    [
        (totals(5, 10, 1, 8), False, "online_preprocessing"),
        (totals(5, 10, 8, 1), True, "remote_io"),
        (totals(5, 10, 8, 1), False, "slow_reads"),
        (totals(5, 10, 1, 1), False, "prefetch_too_shallow"),  # loader 2 s < compute 5 s
        (totals(5, 10, 1, 8, ("junk",)), False, "unused_columns"),
    ],
)
def test_likely_cause_from_the_timings(t, remote, cause):
    v = input_bound("t-0", t, 0.2, remote, prefetch_batches=2)
    assert v.is_warning and v.facts["cause"] == cause
    assert v.facts["exposed_fraction"] == 0.5


def test_with_ray_data_input_workers_the_remedy_is_more_input_workers():
    """Ray Data workers read and preprocess off the rank, so the rank's own read and
    preprocess times are ~0: without knowing that, the cause would be 'prefetch too shallow'."""
    t = totals(5, 10, 0.0, 0.0)
    assert input_bound("t-0", t, 0.2, False, 2).facts["cause"] == "prefetch_too_shallow"
    v = input_bound("t-0", t, 0.2, False, 2, input_workers="ray_data")
    assert v.is_warning and v.facts["cause"] == "input_workers"
    assert "input.num_input_workers" in v.message


def test_below_the_threshold_is_ok():
    v = input_bound("t-0", totals(1, 10, 5, 5), 0.2, True, 2)
    assert not v.is_warning and v.facts["exposed_fraction"] == pytest.approx(0.1)


def test_totals_sum_the_log_rows_over_intervals():
    rows = [
        {
            "step": 10,
            "input/wait_s": 1.0,
            "input/step_s": 2.0,
            "input/read_s": 0.5,
            "input/preprocess_s": 0.1,
        },
        {
            "step": 20,
            "input/wait_s": 0.0,
            "input/step_s": 6.0,
            "input/read_s": 0.5,
            "input/preprocess_s": 0.3,
            "input/unused_columns": "junk",
        },
        {"step": 30, "status": "diverged"},
    ]
    t = InputTotals.from_history(rows)
    assert (t.wait_s, t.step_s, t.read_s, t.preprocess_s) == (1.0, 8.0, 1.0, pytest.approx(0.4))
    assert t.exposed_fraction == 1 / 8 and t.unused_columns == ("junk",)
    assert InputTotals.from_history([{"step": 1}]) is None
    assert (
        is_remote("gs://b/d")
        and is_remote("s3://b/d")
        and not is_remote("/data")
        and not is_remote("memory://x")
    )


def test_a_declared_column_the_workload_never_uses_is_found(tmp_path):
    n = 20
    pixels = np.zeros(n * 64, np.float32)
    pq.write_table(
        pa.table(
            {
                "example_id": pa.array(np.arange(n)),
                "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels), 64),
                "label": pa.array(np.arange(n) % 10),
                "junk": pa.array(np.arange(n)),
            }
        ),
        tmp_path / "a.parquet",
    )
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(str(tmp_path))]
    assert unused_columns(workloads.get(f"{input_workloads.__name__}:JunkDigits"), ranges) == ["junk"]
    assert unused_columns(workloads.get("digits"), ranges) == []


def test_profile_steps_write_a_chrome_trace(digits_dir, tmp_path):
    plan = plan_for(digits_dir, tmp_path / "p", "digits", profile_steps=3)
    run(plan)
    with open(f"{plan.trial_uri}/profile/rank0.trace.json") as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::conv") for n in names)  # the model's forward ran inside it


def test_a_trial_ending_inside_the_profiled_steps_still_writes_its_trace(digits_dir, tmp_path):
    """profile_steps beyond the trial's 40 steps: the trace of the steps run is written at the end."""
    plan = plan_for(digits_dir, tmp_path / "p", "digits", profile_steps=1000)
    run(plan)
    with open(f"{plan.trial_uri}/profile/rank0.trace.json") as f:
        trace = json.load(f)
    assert any(e.get("name", "").startswith("aten::conv") for e in trace["traceEvents"])


@pytest.mark.parametrize(
    "section, message",
    [
        ({"prefetch_batches": -1}, "input.prefetch_batches: must be >= 0"),
        ({"input_bound_threshold": 1.5}, "input.input_bound_threshold: must be in (0, 1)"),
        ({"shuffle_window_row_groups": 0}, "input.shuffle_window_row_groups: must be > 0"),
        ({"cache_mb": -1}, "input.cache_mb: must be >= 0"),
        ({"prefetch": 2}, "input.prefetch"),
    ],
)
def test_bad_input_settings_name_the_field(digits_dir, tmp_path, section, message):
    from service.core.errors import SpecError

    with pytest.raises(SpecError) as e:
        plan_for(digits_dir, tmp_path, "digits", **section)
    assert str(e.value).startswith(message)
