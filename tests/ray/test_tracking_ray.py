"""Tracking of a real study on the shared Ray cluster: the coordinator's Ray metrics on the
node's Prometheus endpoint while it runs, the storage root's study row, the MLflow mirror
(a local file store), and `playbook report` rendered in headless Chromium."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import time
import urllib.request

import numpy as np
import pyarrow.parquet as pq
import pytest

from service.tracking import provenance
from tests.helpers.studies import make_study

pytestmark = pytest.mark.ray
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$")


def scrape(port: int, study: str) -> dict[str, float]:
    """`ray_playbook_*` samples of `study` on the node's metrics endpoint (name -> value; the
    largest when several worker processes export the same name)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m and m["name"].startswith("ray_playbook_") and f'study="{study}"' in m["labels"]:
            out[m["name"]] = max(out.get(m["name"], -math.inf), float(m["value"]))
    return out


@pytest.fixture(scope="module")
def tracked_study(ray_cluster, digits_dir, tmp_path_factory):
    """Run a 2-trial study through its coordinator, scraping the metrics endpoint while it
    runs and once more after it finished (before the actor goes)."""
    from service.orchestration.coordinator import NAMESPACE, Coordinator, actor_name

    root = tmp_path_factory.mktemp("tracking")
    mlruns = root / "mlruns"
    study = make_study(
        digits_dir,
        root / "storage",
        name="tracked",
        description="tracking e2e",
        training={
            # Long enough (seconds per trial on the single-worker fast path) for the metrics
            # agent's export period to see trials running.
            "max_train_steps": 4000,
            "eval_every_steps": 1000,
            "validation_sample_size": 120,
            "full_eval_every_steps": 2000,
        },
        tracking={"mlflow_uri": f"file://{mlruns}", "progress_interval_s": 5},
    )
    record = provenance.capture(study.study_uri, study.workload, [REPO])
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    coordinator = Coordinator.options(name=actor_name(study.name), namespace=NAMESPACE).remote(study)
    try:
        future = coordinator.run.remote()
        during = []
        while not ray_cluster.wait([future], timeout=1)[0]:
            during.append(scrape(port, study.name))
        rows = ray_cluster.get(future)
        # Past the agent's ~20 s gauge TTL after the last trial event: the values are still
        # there only because the coordinator republishes them.
        ended, after = time.monotonic(), {}
        while time.monotonic() < ended + 120:
            after = scrape(port, study.name)
            if time.monotonic() > ended + 30 and after.get("ray_playbook_trials_finished") == len(rows):
                break
            time.sleep(1)
    finally:
        ray_cluster.kill(coordinator)
    return study, rows, record, during, after, str(mlruns)


def metrics_log(study, trial) -> list[dict]:
    with open(os.path.join(study.study_uri, "trials", trial, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_metrics_on_the_node_endpoint_during_and_after_the_study(tracked_study):
    study, rows, _, during, after, _ = tracked_study
    assert len(during) > 5, "the study ended before the endpoint could be scraped"
    seen_running = max(s.get("ray_playbook_trials_running", 0) for s in during)
    assert seen_running >= 1, f"no running trial seen during the study: {during[-3:]}"
    assert after["ray_playbook_trials_finished"] == len(rows) == 2
    assert after["ray_playbook_trials_failed"] == 0
    # The best metric so far, against the best evaluation in the rank-0 metrics logs.
    evals = [r[study.training.metric] for row in rows for r in metrics_log(study, row["trial_name"])]
    assert after["ray_playbook_best_metric"] == pytest.approx(float(np.min(evals)))
    # one evaluation report per eval point, each a row of the trial's metrics log
    evals_logged = sum(len(metrics_log(study, r["trial_name"])) for r in rows)
    assert after["ray_playbook_trial_reports_total"] == evals_logged
    assert "ray_playbook_steps_per_s" in after


def test_study_row_in_the_storage_root_table(tracked_study):
    study, rows, record, *_ = tracked_study
    table = pq.read_table(os.path.join(study.storage, "studies.parquet")).to_pylist()
    (row,) = [r for r in table if r["study"] == study.name]
    best = min(rows, key=lambda r: r["best_metric"])
    assert row["state"] == "finished" and row["description"] == "tracking e2e"
    assert (row["trials"], row["trials_finished"], row["trials_diverged"], row["trials_failed"]) == (
        2,
        2,
        0,
        0,
    )
    assert row["best_trial"] == best["trial_name"] and row["best_metric"] == best["best_metric"]
    assert row["best_step"] == best["best_step"] and os.path.isdir(row["best_checkpoint"])
    assert os.path.isfile(row["study_file"])
    assert shlex.split(row["reproduce"]) == record["reproduce"]
    assert row["git_commit"] == record["git_commit"] and len(record["git_commit"]) == 40
    assert row["git_dirty"] == record["git_dirty"]
    assert row["uncommitted_diff"] == record["uncommitted_diff"]


def test_mlflow_mirror_has_params_metrics_and_commit(tracked_study):
    study, rows, record, *_, mlruns = tracked_study
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file://{mlruns}")
    exp = client.get_experiment_by_name(study.name)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == sorted(r["trial_name"] for r in rows)
    for row in rows:
        run = runs[row["trial_name"]]
        assert float(run.data.params["learning_rate"]) == pytest.approx(row["hp/learning_rate"])
        assert run.data.tags["git_commit"] == record["git_commit"]
        assert run.data.tags["playbook.status"] == "FINISHED" and run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, study.training.metric)
        log = metrics_log(study, row["trial_name"])
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
            (r["step"], pytest.approx(r[study.training.metric])) for r in log
        ]


def test_report_renders_in_headless_chromium(tracked_study, tmp_path, capsys):
    from PIL import Image

    from service import cli
    from tests.helpers.chromium import check_page

    study, rows, *_ = tracked_study
    out = tmp_path / "report.html"
    assert cli.main(["report", study.study_uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in rows:  # the terminal table: a line per trial with its best metric
        assert any(
            line.startswith(row["trial_name"]) and f"{row['best_metric']:.4g}" in line
            for line in printed.splitlines()
        )
    assert re.search(r"^study: (WARNING )?eval_sample_bias: ", printed, re.M)

    page = check_page(str(out))
    assert page.console_errors == []
    titles = [i["alt"] for i in page.images]
    assert titles == [
        "training loss",
        study.training.metric,
        "hyperparameter axes",
        "best-step positions",
        "eval-sample bias",
    ]
    assert all(i["complete"] and i["naturalWidth"] > 0 and i["naturalHeight"] > 0 for i in page.images)
    shot = Image.open(io.BytesIO(page.screenshot_png)).convert("RGB")
    (tmp_path / "screenshot.png").write_bytes(page.screenshot_png)
    pixels = np.asarray(shot).reshape(-1, 3).astype(int)
    assert (pixels.min(axis=1) < 250).mean() > 0.05  # not a blank page
    # the plots' red best-trial marks are on screen (nothing else on the page is that red)
    assert (np.abs(pixels - [214, 39, 40]).max(axis=1) < 30).sum() > 50
    if os.environ.get("PLAYBOOK_KEEP_SCREENSHOT"):
        shot.save(os.environ["PLAYBOOK_KEEP_SCREENSHOT"])
