"""The isolation plot's points (`analysis.isolation`) on hand-made trial rows with answers worked
out here: the best per scientific value over the nuisance hyperparameters (a tie to the earlier
trial name), diverged trials left out and counted, a value whose trials all diverged, the seed
spread of a repeat round's reruns of a best (mean, standard deviation, extremes) and a value
without repeats; then the figure and its caption drawn from them, and the stored study's page in
headless Chromium at 1280 px."""

from __future__ import annotations

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service import report
from service.analysis.isolation import isolation
from service.report.isolation_plot import isolation_figure
from service.study import spec
from tests.helpers.chromium import check_page
from tests.helpers.studies import make_study

SEARCH = {
    "learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 0.5, "scale": "log"},
    "width": {"role": "scientific", "type": "choice", "values": [4, 8, 16]},
}
ROUNDS = [
    {"name": "r1", "num_trials": 9},
    {"name": "r2", "num_trials": 3},
    {"name": "rep", "kind": "repeat", "num_trials": 3, "from_round": "r1"},
]


def row(name: str, width: int, metric: float | None, status: str = "FINISHED", **extra) -> dict:
    return {
        "trial_name": name,
        "round": name.split("-")[0],
        "status": status,
        "best_metric": metric,
        "max_train_steps": 8,
        "hp/width": width,
        "hp/learning_rate": 0.01 + int(name[-1]) / 100,
        **extra,
    }


ROWS = [
    row("r1-0000", 4, 0.30),
    row("r1-0001", 4, 0.25),  # width 4's best: a tie with r1-0004, the earlier name wins
    row("r1-0002", 8, None, "DIVERGED", diverged_at_step=3),
    row("r1-0003", 8, 0.40),
    row("r1-0004", 4, 0.25),
    row("r1-0005", 16, None, "DIVERGED", diverged_at_step=2),
    row("r1-0006", 8, None, "FAILED"),  # no result, not diverged: neither a result nor counted
    row("r1-0007", 8, math.nan),  # finished without a finite metric: not a result
    row("r1-0008", 16, 0.50),  # width 16: no repeats
    row("r2-0000", 4, 0.20),
    row("r2-0001", 4, None, "DIVERGED", diverged_at_step=5),
    row("r2-0002", 8, None, "DIVERGED", diverged_at_step=1),  # width 8 in r2: every trial diverged
    row("rep-0000", 4, 0.27, repeat_of="r1-0001", seed=1),
    row("rep-0001", 4, 0.31, repeat_of="r1-0001", seed=2),
    row("rep-0002", 4, 0.22, repeat_of="r1-0001", seed=3),
    row("rep-0003", 8, None, "DIVERGED", repeat_of="r1-0003", seed=1, diverged_at_step=4),
    row("rep-0004", 8, 0.41, repeat_of="r1-0003", seed=2),
]
REPEATS_OF_4 = [0.27, 0.31, 0.22]


def by_hand_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation with a plain loop."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@pytest.fixture
def study(digits_dir, tmp_path):
    return make_study(digits_dir, tmp_path, name="isolation", search=SEARCH, rounds=ROUNDS)


def test_points_are_the_best_per_value_with_diverged_counted_and_the_repeats_spread(study):
    (r1, r2) = isolation(study, ROWS)["width"]  # no series for the repeat round itself
    assert (r1.round, r2.round) == ("r1", "r2")
    got = [(p.value, p.best_metric, p.trial_name, p.num_results, p.num_diverged) for p in r1.points]
    assert got == [(4, 0.25, "r1-0001", 3, 0), (8, 0.40, "r1-0003", 1, 1), (16, 0.50, "r1-0008", 1, 1)]
    four, eight, sixteen = r1.points
    mean, std = by_hand_mean_std(REPEATS_OF_4)
    assert four.repeats.round == "rep" and four.repeats.values == tuple(REPEATS_OF_4)
    assert four.repeats.n == 3 and four.repeats.diverged == 0
    assert math.isclose(four.repeats.mean, mean) and math.isclose(four.repeats.std, std)
    assert (four.repeats.min, four.repeats.max) == (0.22, 0.31)
    assert eight.repeats.values == (0.41,) and eight.repeats.diverged == 1 and math.isnan(eight.repeats.std)
    assert sixteen.repeats is None
    got = [
        (p.value, p.best_metric, p.trial_name, p.num_results, p.num_diverged, p.repeats) for p in r2.points
    ]
    assert got == [(4, 0.20, "r2-0000", 1, 1, None), (8, None, None, 0, 1, None)]


def test_max_mode_picks_the_highest_and_numbers_sort_ascending(digits_dir, tmp_path):
    search = {**SEARCH, "width": {"role": "scientific", "type": "int", "min": 2, "max": 64}}
    training = {"metric": "validation/accuracy", "mode": "max"}
    study = make_study(digits_dir, tmp_path, search=search, rounds=ROUNDS[:1], training=training)
    rows = [row("r1-0000", 32, 0.7), row("r1-0001", 2, 0.9), row("r1-0002", 32, 0.8), row("r1-0003", 2, 0.5)]
    (r1,) = isolation(study, rows)["width"]
    assert [(p.value, p.best_metric, p.trial_name) for p in r1.points] == [
        (2, 0.9, "r1-0001"),
        (32, 0.8, "r1-0002"),
    ]


def test_two_scientific_hyperparameters_each_a_plot_whose_spread_is_of_the_marker_trial_alone(
    digits_dir, tmp_path
):
    """The repeat round reruns the best of each (width, depth): width 4's marker is (4, 2)'s
    best, and its spread is of that configuration's repeats, not (4, 1)'s as well."""
    search = {**SEARCH, "depth": {"role": "scientific", "type": "choice", "values": [1, 2]}}
    study = make_study(digits_dir, tmp_path, search=search, rounds=ROUNDS)
    cells = {"r1-0000": (4, 1, 0.3), "r1-0001": (4, 2, 0.2), "r1-0002": (8, 1, 0.5), "r1-0003": (8, 2, 0.4)}
    rows = [row(n, w, m, **{"hp/depth": d}) for n, (w, d, m) in cells.items()]
    reps = [("r1-0001", 0.21), ("r1-0001", 0.23), ("r1-0000", 0.31), ("r1-0000", 0.33)]
    rows += [row(f"rep-000{i}", cells[of][0], m, repeat_of=of, **{"hp/depth": cells[of][1]}) for i, (of, m) in
             enumerate(reps)]  # fmt: skip
    got = {
        name: [(p.value, p.best_metric, p.trial_name, p.repeats and p.repeats.values) for p in r1.points]
        for name, (r1,) in isolation(study, rows).items()
    }
    assert got == {
        "width": [(4, 0.2, "r1-0001", (0.21, 0.23)), (8, 0.4, "r1-0003", None)],
        "depth": [(1, 0.3, "r1-0000", (0.31, 0.33)), (2, 0.2, "r1-0001", (0.21, 0.23))],
    }


def test_no_scientific_hyperparameter_no_plot(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path)  # learning_rate, momentum nuisance; width fixed
    assert isolation(study, [row("explore-0000", 4, 0.3)]) == {}
    data = report.StudyData(study, study.study_uri, [row("explore-0000", 4, 0.3)], {}, [], {})
    assert isolation_figure(data) is None


def test_the_figure_draws_the_bests_the_repeats_and_the_all_diverged_value(study):
    data = report.StudyData(study, study.study_uri, ROWS, {}, [], {})
    fig, caption = isolation_figure(data)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8", "16"]
    assert ax.get_ylabel() == "best validation/loss (lower is better)"
    r1_line, r2_line = (line for line in ax.lines if line.get_marker() == "o")
    assert list(r1_line.get_ydata()) == [0.25, 0.40, 0.50] and list(r2_line.get_ydata()) == [0.20]
    assert list(r1_line.get_xdata()) == pytest.approx([-0.1, 0.9, 1.9])  # r1 left of r2 in each value
    (dots,) = [c for c in ax.collections if c.get_label() == "rep: seed repeats (dots), mean ± std"]
    got = [(round(float(x), 6), float(y)) for x, y in dots.get_offsets()]  # right of r1's markers
    assert got == [(-0.03, v) for v in REPEATS_OF_4] + [(0.97, 0.41)]
    mean, std = by_hand_mean_std(REPEATS_OF_4)
    bars = [c for c in ax.collections if type(c).__name__ == "LineCollection"]
    spans = sorted(tuple(sorted(seg[:, 1])) for c in bars for seg in c.get_segments())
    assert spans[0] == pytest.approx((mean - std, mean + std))  # width 4; width 8's one repeat: no span
    crosses = [c for c in ax.collections if c.get_label() == "all trials diverged"]
    assert [x for x, _ in crosses[0].get_offsets()] == [1.1]  # width 8, where r2's only trial diverged
    assert caption.startswith(
        "Isolation plot of width: each marker is the best validation/loss (lower is better) among one "
        "round's finished trials with that value over the nuisance hyperparameters (learning_rate); "
        "rounds r1, r2."
    )
    assert "(round rep; width=4: 3 of r1-0001; width=8: 1 of r1-0003)" in caption
    assert caption.endswith("Diverged trials left out: 2 in r1, 2 in r2, 1 in rep.")


def store(study, rows: list[dict]) -> None:
    os.makedirs(study.study_uri)
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    keys = sorted({k for r in rows for k in r})
    pq.write_table(
        pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]),
        os.path.join(study.study_uri, "trials.parquet"),
    )
    with open(os.path.join(study.study_uri, "verdicts.json"), "w") as f:
        json.dump([], f)


ISOLATION_IMAGE = """(() => {
  const img = [...document.images].find(i => i.alt == 'isolation plot');
  if (!img) return null;
  const box = img.getBoundingClientRect(), caption = img.nextElementSibling;
  return {left: box.left, right: box.right, width: box.width, height: box.height, drawn: img.naturalWidth,
          visible: getComputedStyle(img).visibility == 'visible' && getComputedStyle(img).display != 'none',
          caption: caption && caption.className == 'caption' ? caption.textContent : null,
          scroll: document.documentElement.scrollWidth};
})()"""


def test_the_stored_study_page_shows_the_isolation_plot_in_chromium(study, tmp_path):
    """In headless Chromium at 1280 px: the isolation plot's image has loaded, is visible, at
    least 800 px wide, shown at three quarters of its drawn size or more, inside the page's
    width, with its caption under it."""
    store(study, ROWS)
    out = tmp_path / "report.html"
    report.write(report.load(study.study_uri), str(out))
    page = check_page(str(out), evaluate=(ISOLATION_IMAGE,))
    (img,) = page.values
    assert page.console_errors == []
    assert img is not None, "no isolation plot on the page"
    assert (
        img["visible"] and img["height"] > 300 and img["width"] >= 800 and img["width"] >= 0.75 * img["drawn"]
    )
    assert img["left"] >= 0 and img["right"] <= 1280 and img["scroll"] <= 1280
    assert img["caption"].startswith("Isolation plot of width:")
    shown = [i for i in page.images if i["alt"] == "isolation plot"]
    assert shown[0]["complete"] and shown[0]["naturalWidth"] > 0
