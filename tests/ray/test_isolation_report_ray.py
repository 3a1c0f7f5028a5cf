"""A real two-round digits study on the shared Ray cluster: a grid over a scientific width (the
learning rate fixed, to keep the study small: the best over nuisance hyperparameters is tested on
hand-made rows in tests/unit/test_isolation.py), then a repeat round rerunning each width's best
with two other seeds.
Its report, in headless Chromium at 1280 px, shows the isolation plot inside the page's width,
and the plot's markers and seed repeats are the values worked out here from the trial table."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from service.core.formatting import fmt
from tests.helpers.studies import make_study, run_within_timeout

pytestmark = pytest.mark.ray
WIDTHS = [4, 8]


@pytest.fixture(scope="module")
def repeated(ray_cluster, digits_dir, tmp_path_factory):
    study = make_study(
        digits_dir,
        tmp_path_factory.mktemp("storage"),
        name="isolation",
        training={
            "max_train_steps": 4,
            "eval_every_steps": 2,
            "num_checkpoints_to_keep": 1,
            "schedule": {"kind": "constant"},
        },
        search={
            "learning_rate": {"role": "fixed", "value": 0.3},
            "width": {"role": "scientific", "type": "choice", "values": WIDTHS},
        },
        rounds=[
            {"name": "grid", "kind": "grid", "num_trials": 2},
            {"name": "rep", "kind": "repeat", "num_trials": 2},
        ],
    )
    run_within_timeout(study)
    rows = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    return study, rows


def by_hand(rows: list[dict]) -> dict:
    """Per width: (the grid round's best trial, its metric, its repeats' metrics), with a loop."""
    out = {}
    for width in WIDTHS:
        grid = [r for r in rows if r["round"] == "grid" and r["hp/width"] == width]
        best = min(grid, key=lambda r: (r["best_metric"], r["trial_name"]))
        reps = sorted(
            (r for r in rows if r.get("repeat_of") == best["trial_name"]), key=lambda r: r["trial_name"]
        )
        out[width] = (best["trial_name"], best["best_metric"], [r["best_metric"] for r in reps])
    return out


ISOLATION_IMAGE = """(() => {
  const img = [...document.images].find(i => i.alt == 'isolation plot');
  if (!img) return null;
  const box = img.getBoundingClientRect(), caption = img.nextElementSibling;
  return {right: box.right, width: box.width, height: box.height, drawn: img.naturalWidth,
          complete: img.complete, visible: getComputedStyle(img).visibility == 'visible',
          caption: caption && caption.className == 'caption' ? caption.textContent : null,
          scroll: document.documentElement.scrollWidth};
})()"""


def test_the_report_shows_the_isolation_plot_with_the_seed_spread(repeated, tmp_path):
    from service import report
    from service.report.isolation_plot import isolation_figure
    from tests.helpers.chromium import check_page

    study, rows = repeated
    assert all(r["status"] == "FINISHED" for r in rows) and len(rows) == 6
    expected = by_hand(rows)
    data = report.load(study.study_uri)
    fig, caption = isolation_figure(data)
    (ax,) = fig.axes
    (markers,) = [line for line in ax.lines if line.get_marker() == "o"]
    assert list(markers.get_ydata()) == [expected[w][1] for w in WIDTHS]
    (dots,) = [c for c in ax.collections if c.get_label() == "rep: seed repeats (dots), mean ± std"]
    assert sorted(y for _, y in dots.get_offsets()) == sorted(v for w in WIDTHS for v in expected[w][2])
    for w in WIDTHS:
        assert len(expected[w][2]) == 2 and f"width={w}: 2 of {expected[w][0]}" in caption
    mean, std = np.mean(expected[4][2]), np.std(expected[4][2], ddof=1)
    bars = sorted(tuple(sorted(s[:, 1])) for c in ax.collections if type(c).__name__ == "LineCollection"
                  for s in c.get_segments())  # fmt: skip
    assert any(b == pytest.approx((mean - std, mean + std)) for b in bars), (fmt(mean), fmt(std), bars)

    out = tmp_path / "report.html"
    report.write(data, str(out))
    page = check_page(str(out), evaluate=(ISOLATION_IMAGE,))
    (img,) = page.values
    assert page.console_errors == []
    assert img is not None, "no isolation plot on the page"
    assert img["complete"] and img["drawn"] > 0 and img["visible"] and img["height"] > 300
    assert img["width"] >= 800 and img["width"] >= 0.75 * img["drawn"]
    assert img["right"] <= 1280 and img["scroll"] <= 1280
    assert img["caption"] == caption
