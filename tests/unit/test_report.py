"""The report from hand-made study files (no Ray): any saved verdict kind as a sentence, the
divergences, the hyperparameter-axis plot's bounds and log axis, a clear error for a missing
study, and that the Chromium checker catches a broken image and a console error."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service import cli, report
from service.report import plots
from service.study import spec
from tests.helpers.chromium import check_page
from tests.helpers.studies import make_study


@pytest.fixture
def stored(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path)
    os.makedirs(study.study_uri)
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    rows = [
        {"trial_name": "explore-0000", "round": "explore", "status": "FINISHED", "max_train_steps": 40,
         "best_metric": 0.4, "best_step": 40, "hp/learning_rate": 0.02, "hp/momentum": 0.6},
        {"trial_name": "explore-0001", "round": "explore", "status": "FINISHED", "max_train_steps": 40,
         "best_metric": 0.2, "best_step": 20, "hp/learning_rate": 0.1, "hp/momentum": 0.9},
        {"trial_name": "explore-0002", "round": "explore", "status": "DIVERGED", "max_train_steps": 40,
         "diverged_at_step": 13, "hp/learning_rate": 0.45, "hp/momentum": 0.93},
    ]  # fmt: skip
    keys = sorted({k for r in rows for k in r})  # from_pylist takes its schema from the first row
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])
    pq.write_table(table, os.path.join(study.study_uri, "trials.parquet"))
    verdicts = [
        {"round": "explore", "scientific": "", "verdicts": [
            {"kind": "input_bound", "subject": "explore-0001", "severity": "warning",
             "message": "explore-0001 waited for input 60% of its step time."}]}
    ]  # fmt: skip
    with open(os.path.join(study.study_uri, "verdicts.json"), "w") as f:
        json.dump(verdicts, f)
    return study


def test_sentences_render_any_verdict_kind_and_divergence(stored):
    data = report.load(stored.study_uri)
    page, sentences = report.build(data)
    texts = [(s.kind, s.severity, s.text) for s in sentences]
    assert ("input_bound", "warning", "explore-0001 waited for input 60% of its step time.") in texts
    (div,) = [s for s in sentences if s.kind == "divergence"]
    assert "explore-0002" in div.text and "step 13" in div.text and "learning_rate=0.45" in div.text
    assert "waited for input 60%" in page and "<tr class=best><td>explore-0001<" in page


def test_hparam_axes_draw_the_bounds_on_a_log_axis(stored):
    fig = plots.hparam_axes(report.load(stored.study_uri))
    lr_ax, momentum_ax = fig.axes
    assert lr_ax.get_xscale() == "log" and momentum_ax.get_xscale() == "linear"
    lr = stored.search["learning_rate"]
    vlines = sorted(line.get_xdata()[0] for line in lr_ax.lines)
    assert vlines == [lr.min, lr.max]
    lo, hi = lr_ax.get_xlim()
    assert lo < lr.min and hi > lr.max


def test_missing_study_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stored study there (no study.yaml)" in err[0]


def test_chromium_check_catches_a_broken_image_and_a_console_error(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<html><body><img alt="x" src="data:image/png;base64,bm90IGEgcG5n">'
        "<script>console.error('boom')</script></body></html>"
    )
    page = check_page(str(bad))
    assert page.images[0]["naturalWidth"] == 0
    assert any("boom" in e for e in page.console_errors)
