"""The report from hand-made study files (no Ray): any saved verdict kind as a sentence, the
divergences, the hyperparameter-axis plot's bounds and log axis, a clear error for a missing
study, that the Chromium checker catches a broken image and a console error, and a crowded
round's page in headless Chromium at 1280 px: no overflow, one- or two-line rows (verdicts as
tags), readable plots, sorting by a header click."""

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
from tests.helpers.studies import BASE_STUDY, make_study


def write_stored(study, rows: list[dict]) -> None:
    """The study file and its trial table, as a study's folder holds them."""
    os.makedirs(study.study_uri)
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    keys = sorted({k for r in rows for k in r})  # from_pylist takes its schema from the first row
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])
    pq.write_table(table, os.path.join(study.study_uri, "trials.parquet"))


@pytest.fixture
def stored(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path)
    rows = [
        {"trial_name": "explore-0000", "round": "explore", "status": "FINISHED", "max_train_steps": 40,
         "best_metric": 0.4, "best_step": 40, "hp/learning_rate": 0.02, "hp/momentum": 0.6},
        {"trial_name": "explore-0001", "round": "explore", "status": "FINISHED", "max_train_steps": 40,
         "best_metric": 0.2, "best_step": 20, "hp/learning_rate": 0.1, "hp/momentum": 0.9},
        {"trial_name": "explore-0002", "round": "explore", "status": "DIVERGED", "max_train_steps": 40,
         "diverged_at_step": 13, "hp/learning_rate": 0.45, "hp/momentum": 0.93},
    ]  # fmt: skip
    write_stored(study, rows)
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
    assert "waited for input 60%" in page and '<tr class=best><td data-v="explore-0001">explore-0001<' in page


def test_the_report_names_a_divergence_once(stored, tmp_path, capsys):
    """`playbook report` prints `section: [WARNING ]kind: text`; the divergences are about the
    whole study: `study: WARNING divergence: ...` (it printed `divergence: WARNING divergence:`),
    and the page shows them under a `study` heading with one `divergence` tag."""
    out = tmp_path / "report.html"
    assert cli.main(["report", stored.study_uri, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (div,) = [line for line in lines if "divergence" in line]
    assert div == (
        "study: WARNING divergence: Trial explore-0002 diverged (non-finite training loss) at step 13 "
        "with learning_rate=0.45, momentum=0.93."
    )
    page = out.read_text()
    assert page.count(">divergence<") == 1 and "<h3>study</h3>" in page


def test_hparam_axes_draw_the_bounds_on_a_log_axis(stored):
    fig = plots.hparam_axes(report.load(stored.study_uri))
    lr_ax, momentum_ax = fig.axes
    assert lr_ax.get_xscale() == "log" and momentum_ax.get_xscale() == "linear"
    lr = stored.search["learning_rate"]
    vlines = sorted(line.get_xdata()[0] for line in lr_ax.lines)
    assert vlines == [lr.min, lr.max]
    lo, hi = lr_ax.get_xlim()
    assert lo < lr.min and hi > lr.max


def test_hparam_axes_show_the_searching_rounds_only_a_color_each(digits_dir, tmp_path):
    """An extend round reruns the best configuration longer: its better result at the same
    learning rate is not a point of the search, so it is left off (named in the title), and the
    star is the best trial of the searching rounds; a bayesian round has a color of its own."""
    rounds = [
        {"name": "explore", "num_trials": 2},
        {"name": "bayes", "kind": "bayesian", "num_trials": 1},
        {"name": "longer", "kind": "extend", "num_trials": 1},
    ]
    study = make_study(digits_dir, tmp_path, rounds=rounds)
    steps = study.training.max_train_steps
    row = {"status": "FINISHED", "hp/momentum": 0.9}
    lr = "hp/learning_rate"
    write_stored(study, [
        {**row, "trial_name": "explore-0000", "round": "explore", "best_metric": 0.4, lr: 0.02},
        {**row, "trial_name": "explore-0001", "round": "explore", "best_metric": 0.2, lr: 0.1},
        {**row, "trial_name": "bayes-0000", "round": "bayes", "best_metric": 0.3, lr: 0.05},
        {**row, "trial_name": "longer-0000", "round": "longer", "best_metric": 0.1, lr: 0.1},
    ])  # fmt: skip
    fig = plots.hparam_axes(report.load(study.study_uri))
    lr_ax = fig.axes[0]
    points = {c.get_label(): [tuple(map(float, xy)) for xy in c.get_offsets()] for c in lr_ax.collections}
    assert points == {
        f"explore ({steps} steps)": [(0.02, 0.4), (0.1, 0.2)],
        f"bayes ({steps} steps)": [(0.05, 0.3)],
        "best: explore-0001": [(0.1, 0.2)],
    }
    colors = [tuple(c.get_facecolor()[0]) for c in lr_ax.collections[:2]]
    assert colors[0] != colors[1]
    assert fig.get_suptitle().endswith("left out: longer (one configuration each)")


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


# ----------------------------------------------------------------------------- the page at 1280 px

CROWDED_SEARCH = {
    "weight_decay": {"role": "nuisance", "type": "float", "min": 1e-6, "max": 1e-2, "scale": "log"},
    "dropout": {"role": "nuisance", "type": "float", "min": 0.0, "max": 0.5},
    "width": {"role": "scientific", "type": "choice", "values": [4, 8, 16]},
    "grad_clip_norm": {"role": "nuisance", "type": "float", "min": 0.1, "max": 10.0, "scale": "log"},
    "warmup_steps": {"role": "nuisance", "type": "int", "min": 0, "max": 10},
}
STEPS = list(range(10, 101, 10))
SHAPES = [  # (validation/loss, train/loss): overfitting, still improving, a noisy tail, saturated
    ([1.0, 0.6, 0.4, 0.3, 0.25, 0.27, 0.3, 0.34, 0.38, 0.42], [1.0 - 0.09 * i for i in range(10)]),
    ([1.0 - 0.09 * i for i in range(10)], [1.0 - 0.09 * i for i in range(10)]),
    ([1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.35, 0.4, 0.3, 0.4], [1.0 - 0.09 * i for i in range(10)]),
    ([1.0, 0.3, 0.201] + [0.2] * 7, [1.0, 0.2, 0.1] + [0.1] * 7),
]


def crowded_row(study, i: int) -> dict:
    """Trial i of a crowded round: every tenth diverged, long values everywhere a study has them
    (a gs:// checkpoint URI, the best-step and input-bound sentences)."""
    from service.analysis.verdicts import best_step_position

    name = f"explore-{i:04d}"
    hps = {"hp/learning_rate": 0.011 * 1.09**i, "hp/momentum": 0.5 + 0.011 * i, "hp/width": [4, 8, 16][i % 3],
           "hp/weight_decay": 1.3e-6 * 1.2**i, "hp/dropout": 0.0123 * i, "hp/grad_clip_norm": 0.1 * 1.1**i,
           "hp/warmup_steps": i % 11}  # fmt: skip
    row = {"trial_name": name, "round": "explore", "max_train_steps": 100, "seed": i, **hps}
    if i % 10 == 7:
        return {**row, "status": "DIVERGED", "step": 13, "diverged_at_step": 13}
    best_step = [50, 100, 90, 100][i % 4]
    return {
        **row, "status": "FINISHED", "step": 100, "best_metric": 0.05 + (i * 37 % 40) / 100,
        "best_step": best_step, "step_verdict": best_step_position(name, best_step, 100).message,
        "best_checkpoint": f"gs://a-rather-long-bucket-name/crowded/trials/{name}/checkpoint_{best_step:06d}",
        "input/bound": i % 5 == 0, "input/exposed_fraction": 0.61,
        "input/verdict": f"{name} waited for its input 61% of its step time: reading dominates (remote I/O); "
        "cache the data on local disk or colocate it with the cluster.",
    }  # fmt: skip


@pytest.fixture
def crowded(digits_dir, tmp_path):
    """A stored round of 40 trials over 7 searched hyperparameters, with metrics logs of known
    shapes (clipping logged on every fourth), and its verdicts as the coordinator saves them."""
    from service.analysis.report_lines import round_verdicts

    training = {"max_train_steps": 100, "eval_every_steps": 10, "schedule": {"kind": "cosine"}}
    search = {**BASE_STUDY["search"], **CROWDED_SEARCH}
    study = make_study(digits_dir, tmp_path, name="crowded", search=search, training=training)
    os.makedirs(study.study_uri)
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    rows = [crowded_row(study, i) for i in range(40)]
    for i, r in enumerate(rows):
        metric, train = SHAPES[i % 4]
        n = 2 if r["status"] == "DIVERGED" else len(STEPS)
        clip = {"train/grad_norm": 1.0 + i % 3, "train/clipped_fraction": 0.8} if i % 4 == 3 else {}
        log = study.layout.trial(r["trial_name"]).metrics_log
        os.makedirs(os.path.dirname(log))
        with open(log, "w") as f:
            for s, m, t in list(zip(STEPS, metric, train, strict=True))[:n]:
                f.write(json.dumps({"step": s, "validation/loss": m, "train/loss": t, **clip}) + "\n")
    keys = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]),
                   os.path.join(study.study_uri, "trials.parquet"))  # fmt: skip
    with open(os.path.join(study.study_uri, "verdicts.json"), "w") as f:
        json.dump([round_verdicts(study, "explore", rows)], f)
    return study, rows


TRIALS_TABLE = "[...document.querySelectorAll('table')].find(t => t.tHead)"
LAYOUT = f"""(() => {{
  const table = {TRIALS_TABLE}, td = table.tBodies[0].rows[0].cells[0];
  return {{inner: innerWidth, scroll: document.documentElement.scrollWidth,
          right: table.getBoundingClientRect().right,
          line: parseFloat(getComputedStyle(td).fontSize) * 1.5,
          tallest: Math.max(...[...table.tBodies[0].rows].map(r => r.getBoundingClientRect().height)),
          images: [...document.images].map(i => [i.alt, i.getBoundingClientRect().width, i.naturalWidth])}};
}})()"""
SORT_BY_BEST = f"""(() => {{
  const table = {TRIALS_TABLE};
  [...table.tHead.rows[0].cells].find(th => th.textContent.startsWith('best validation')).click();
  return [...table.tBodies[0].rows].map(r => r.cells[0].textContent);
}})()"""
OPEN_A_TAG = """(() => {
  const summary = [...document.querySelectorAll('details summary')].find(s => s.textContent == 'overfitting');
  if (!summary) return null;
  summary.click();
  const box = summary.parentElement.querySelector('p').getBoundingClientRect();
  return {open: summary.parentElement.open, right: box.right, scroll: document.documentElement.scrollWidth,
          trial: summary.closest('tr').cells[0].textContent, text: summary.parentElement.textContent};
})()"""


def test_the_report_fits_a_laptop_screen_and_sorts_its_trials(crowded, tmp_path):
    """At 1280 px: nothing overflows the page's width, no trial row is taller than two lines
    of text (verdicts are tags), every plot is shown at three quarters of its drawn size or
    more and at least 800 px wide; a click on the best-metric header sorts the trials by it
    (diverged trials, without a metric, last), a second click reverses; a click on a tag
    opens its sentence inside the page."""
    study, rows = crowded
    out = tmp_path / "report.html"
    report.write(report.load(study.study_uri), str(out))
    page = check_page(str(out), evaluate=(LAYOUT, SORT_BY_BEST, SORT_BY_BEST, OPEN_A_TAG))
    (tmp_path / "screenshot.png").write_bytes(page.screenshot_png)
    if os.environ.get("PLAYBOOK_KEEP_SCREENSHOT"):
        (tmp_path / "screenshot.png").rename(os.environ["PLAYBOOK_KEEP_SCREENSHOT"])
    layout, ascending, descending, tag = page.values
    assert page.console_errors == []
    assert layout["inner"] == 1280
    assert layout["scroll"] <= layout["inner"] and layout["right"] <= layout["inner"]
    assert layout["tallest"] <= 2 * layout["line"] + 8, layout  # two lines and the cell padding
    for alt, shown, drawn in layout["images"]:
        assert shown >= 800 and shown >= 0.75 * drawn, (alt, shown, drawn)
    finished = sorted((r for r in rows if r["status"] == "FINISHED"), key=lambda r: r["best_metric"])
    diverged = [r["trial_name"] for r in rows if r["status"] == "DIVERGED"]
    assert ascending == [r["trial_name"] for r in finished] + diverged
    assert descending == [r["trial_name"] for r in reversed(finished)] + diverged
    assert tag is not None and tag["open"]
    assert tag["right"] <= layout["inner"] and tag["scroll"] <= layout["inner"]
    onset = {0: 50, 2: 90}[int(tag["trial"].split("-")[1]) % 4]  # the overfitting and noisy shapes
    assert tag["text"].startswith(f"overfitting{tag['trial']} overfits from step {onset}:")
