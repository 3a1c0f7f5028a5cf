"""The one home of each shared idea in service/core: the trial status, the order by a metric and
its mode, the number formatter and the parquet+CSV table writer, against hand-worked values."""

from __future__ import annotations

import io
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.core import ranking, tables
from service.core.formatting import cell, fmt
from service.core.trial_status import DONE, TrialStatus
from service.tracking import study_index

NAN, INF = math.nan, math.inf


# ----------------------------------------------------------------------------- trial status


def test_a_status_is_its_string_in_the_table_and_lower_case_in_a_trials_reports():
    statuses = ["PENDING", "RUNNING", "FINISHED", "DIVERGED", "FAILED", "STOPPED"]
    assert [s.value for s in TrialStatus] == statuses
    assert TrialStatus.FINISHED == "FINISHED" and f"{TrialStatus.FAILED}" == "FAILED"
    assert TrialStatus.DIVERGED.reported == "diverged" and type(TrialStatus.DIVERGED.reported) is str
    assert TrialStatus.of_report("failed") is TrialStatus.FAILED
    assert DONE == ("FINISHED", "DIVERGED")
    buf = io.BytesIO()
    pq.write_table(pa.table({"status": [TrialStatus.RUNNING, "PENDING"]}), buf)
    assert pq.read_table(buf).column("status").to_pylist() == ["RUNNING", "PENDING"]


# ----------------------------------------------------------------------------- one trial's evaluations

# A metric at steps 1..6: steps 2, 3 and 5 tie for the lowest value.
TIED_MIN = [0.5, 0.3, 0.3, 0.4, 0.3, 0.6]


def history(values):
    return [{"step": step, "m": v} for step, v in enumerate(values, start=1)]


def test_the_best_evaluation_on_a_tie_is_the_later_step_for_min_and_for_max():
    assert ranking.best_row(history(TIED_MIN), "m", "min")["step"] == 5
    assert ranking.best_row(history([0.5, 0.7, 0.7, 0.2]), "m", "max")["step"] == 3


def test_a_non_finite_evaluation_is_never_the_best():
    # min: NaN and -inf are not "lower"; max: inf is not "higher"; the finite 0.4 / 0.1 win.
    assert ranking.best_row(history([NAN, -INF, 0.4]), "m", "min")["step"] == 3
    assert ranking.best_row(history([INF, 0.1, NAN]), "m", "max")["step"] == 2
    assert ranking.best_row(history([NAN, INF]), "m", "min") is None
    assert ranking.best_row([], "m", "max") is None


def test_a_diverged_trials_last_row_reports_the_worst_value_and_is_not_its_best():
    rows = history([0.4, 0.35]) + [{"step": 3, "m": ranking.worst("min"), "status": "diverged"}]
    assert ranking.best_row(rows, "m", "min")["step"] == 2
    assert ranking.worst("min") == INF and ranking.worst("max") == -INF


def test_rank_orders_by_metric_then_later_step_with_non_finite_last():
    assert ranking.rank(0.3, 5, "min") == (0.3, -5)
    assert ranking.rank(0.3, 5, "max") == (-0.3, -5)
    assert ranking.rank(NAN, 1, "min") == (INF, -1)
    keys = sorted((ranking.rank(v, s, "min"), s) for s, v in enumerate(TIED_MIN, start=1))
    assert [s for _, s in keys] == [5, 3, 2, 4, 1, 6]


def test_a_mode_that_is_neither_min_nor_max_is_refused():
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        ranking.sign("minimum")


# ----------------------------------------------------------------------------- a study's trials


def trial(name, metric, status="FINISHED"):
    return {"trial_name": name, "status": status, "best_metric": metric, "best_step": 10}


# Rows in the order a table may hold them: "b" before "a", which tie.
TRIALS = [
    trial("r-b", 0.2),
    trial("r-a", 0.2),
    trial("r-c", 0.1, "DIVERGED"),
    trial("r-d", None),
    trial("r-e", NAN),
    trial("r-f", INF),
    trial("r-g", 0.05, "FAILED"),
    trial("r-h", 0.3),
]


def test_trials_rank_by_best_metric_then_earlier_name_finished_and_finite_only():
    assert [r["trial_name"] for r in ranking.ranked_results(TRIALS, "min")] == ["r-a", "r-b", "r-h"]
    assert [r["trial_name"] for r in ranking.ranked_results(TRIALS, "max")] == ["r-h", "r-a", "r-b"]
    assert ranking.best_result(TRIALS, "min")["trial_name"] == "r-a"
    assert ranking.best_result(TRIALS[2:7], "min") is None


def test_the_studies_table_names_the_same_best_trial_as_the_report_on_a_tie():
    # Before: the studies table took the first of the tied rows in table order ("r-b"), the
    # report and the next round the earlier name ("r-a"); a FINISHED trial without a finite
    # best_metric ("r-f", inf) was a candidate.
    row = study_index.study_row("s", "/tmp/s", "", "m", "min", TRIALS, None, "finished")
    assert (row["best_trial"], row["best_metric"]) == ("r-a", 0.2)
    only_inf = study_index.study_row("s", "/tmp/s", "", "m", "min", [trial("r-f", INF)], None, "finished")
    assert only_inf["best_trial"] is None and only_inf["best_metric"] is None
    assert (row["trials_finished"], row["trials_diverged"], row["trials_failed"]) == (6, 1, 1)


# ----------------------------------------------------------------------------- number formatter


@pytest.mark.parametrize(
    "value, text",
    [
        (0.123456, "0.1235"),
        (123456.0, "1.235e+05"),
        (1e-9, "1e-09"),
        (2.0, "2"),
        (3, "3"),
        (np.int64(7), "7"),
        (np.float32(0.5), "0.5"),
        (True, "True"),
        (NAN, "nan"),
        (-INF, "-inf"),
        ("FINISHED", "FINISHED"),
        (None, "None"),
    ],
)
def test_fmt(value, text):
    assert fmt(value) == text


def test_a_cell_is_fmt_with_a_dash_for_a_missing_value():
    assert [cell(v) for v in (None, 0.123456, TrialStatus.FINISHED, 12)] == ["-", "0.1235", "FINISHED", "12"]


# ----------------------------------------------------------------------------- parquet + CSV


def test_columns_put_the_leading_ones_first_then_the_rest_sorted():
    rows = [{"b": 1, "a": 2}, {"z": 3, "c": None}]
    cols = tables.columns(rows, ("c", "a"))
    assert list(cols.items()) == [("c", [None, None]), ("a", [2, None]), ("b", [1, None]), ("z", [None, 3])]


def test_a_table_is_written_as_parquet_and_csv(tmp_path):
    rows = [{"name": "x", "n": 1, "v": 0.5}, {"name": "y", "n": None, "v": 2.25}]
    parquet, csv = str(tmp_path / "t.parquet"), str(tmp_path / "t.csv")
    tables.write_parquet_csv(pa.table(tables.columns(rows, ("name",))), parquet, csv)
    assert pq.read_table(parquet).to_pylist() == rows
    assert open(csv).read() == '"name","n","v"\n"x",1,0.5\n"y",,2.25\n'


def test_status_prints_the_same_best_trial_on_a_tie(capsys):
    from service.cli.results import print_table

    print_table(TRIALS, "m", "min")
    # Before: the first of the tied rows in table order ("r-b").
    assert "best trial: r-a m=0.2 at step 10" in capsys.readouterr().out
