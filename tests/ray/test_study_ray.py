"""A real round-1 study on a local Ray cluster: trial rows, best-N checkpoint retention and the
retrospective best checkpoint, each checked against an independent computation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from service.distributed import checkpoint
from tests.helpers.curve_rules import plain_curve_kinds
from tests.helpers.studies import digits_logits, folder_state, make_study

pytestmark = pytest.mark.ray
MAX_STEPS, EVERY, KEEP = 100, 20, 2


@pytest.fixture(scope="module")
def finished_study(ray_cluster, digits_dir, tmp_path_factory):
    from service.orchestration.study_run import run_study

    storage = tmp_path_factory.mktemp("storage")
    study = make_study(
        digits_dir,
        storage,
        name="ray-e2e",
        training={"max_train_steps": MAX_STEPS, "eval_every_steps": EVERY, "num_checkpoints_to_keep": KEEP},
        rounds=[
            {"name": "explore", "num_trials": 2},
            {"name": "exploit", "kind": "extend", "num_trials": 1, "step_multiplier": 1.6},
        ],
    )
    rows = run_study(study)
    return study, [r for r in rows if r["round"] == "explore"], [r for r in rows if r["round"] == "exploit"]


def metrics_log(study, trial_name) -> list[dict]:
    path = os.path.join(study.study_uri, "trials", trial_name, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f]


def kept_checkpoints(study, trial_name) -> dict[int, str]:
    trial_dir = os.path.join(study.study_uri, "trials", trial_name)
    out = {}
    for d in os.listdir(trial_dir):
        if d.startswith("checkpoint_") and os.path.isdir(os.path.join(trial_dir, d)):
            with open(os.path.join(trial_dir, d, checkpoint.META_FILE)) as f:
                out[json.load(f)["step"]] = os.path.join(trial_dir, d)
    return out


def test_every_trial_has_a_finished_row_on_storage(finished_study):
    study, rows, _ = finished_study
    table = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in table) == ["exploit-0000", "explore-0000", "explore-0001"]
    assert os.path.exists(os.path.join(study.study_uri, "trials.csv"))
    assert os.path.exists(os.path.join(study.study_uri, "study.yaml"))
    for row in table:
        assert row["status"] == "FINISHED"
        assert row["step"] == (MAX_STEPS if row["round"] == "explore" else 160)
        lr = study.search["learning_rate"]
        assert lr.min <= row["hp/learning_rate"] <= lr.max
        assert row["hp/width"] == 4


def test_row_best_metric_is_the_best_evaluation_of_the_log(finished_study):
    study, rows, _ = finished_study
    for row in rows:
        log = metrics_log(study, row["trial_name"])
        assert [r["step"] for r in log] == list(range(EVERY, MAX_STEPS + 1, EVERY))
        losses = [r["validation/loss"] for r in log]
        i = int(np.argmin(losses))
        assert row["best_step"] == log[i]["step"]
        assert row["best_metric"] == pytest.approx(losses[i])


def test_only_the_n_best_and_the_latest_checkpoints_are_kept(finished_study):
    study, rows, _ = finished_study
    for row in rows:
        log = metrics_log(study, row["trial_name"])
        by_loss = sorted(log, key=lambda r: r["validation/loss"])
        expected = {r["step"] for r in by_loss[:KEEP]} | {MAX_STEPS}
        assert set(kept_checkpoints(study, row["trial_name"])) == expected


def test_best_checkpoint_reproduces_its_metric_independently(finished_study, digits_dir):
    study, rows, _ = finished_study
    for row in rows:
        ckpt_dir = row["best_checkpoint"]
        assert ckpt_dir == kept_checkpoints(study, row["trial_name"])[row["best_step"]]
        state = checkpoint.load(ckpt_dir)
        assert state.step == row["best_step"]
        logits, y = digits_logits(state, digits_dir / "validation")
        logp = logits - logits.max(1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
        loss = -logp[np.arange(len(y)), y].mean()
        assert math.isclose(loss, row["best_metric"], rel_tol=1e-4)


def stored_status(study, *target: str) -> subprocess.CompletedProcess:
    """`playbook status NAME --storage ROOT` (or `playbook status TARGET`) from a shell with no
    Ray cluster to ask."""
    return subprocess.run(
        [sys.executable, "-m", "service", "status", *(target or (study.name, "--storage", study.storage))],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_ADDRESS": ""},
        timeout=120,
    )


def test_status_reads_the_stored_study(finished_study):
    study, _, _ = finished_study
    out = stored_status(study)
    assert out.returncode == 0, out.stderr
    assert "explore-0000" in out.stdout and "explore-0001" in out.stdout
    assert "best trial:" in out.stdout


def test_status_of_a_study_folder_is_the_status_by_name(finished_study):
    """`playbook status` takes the study's folder, as `playbook report` does."""
    study, _, _ = finished_study
    by_name, by_folder = stored_status(study), stored_status(study, study.study_uri)
    assert by_folder.returncode == 0, by_folder.stderr
    assert by_folder.stdout == by_name.stdout and "explore-0000" in by_folder.stdout


def test_status_of_a_path_that_is_no_study_folder_says_so(finished_study, tmp_path):
    study, _, _ = finished_study
    for target in (str(tmp_path / "nowhere"), str(tmp_path)):
        out = stored_status(study, target)
        assert out.returncode == 2 and out.stdout == ""
        assert (
            out.stderr.strip()
            .splitlines()[-1]
            .endswith(f"{target}: no study.yaml there (not a study folder)")
        )
    out = stored_status(study, study.study_uri, "--storage", study.storage)
    assert out.returncode == 2 and "--storage goes with a study name" in out.stderr


def test_rerunning_a_finished_study_trains_nothing_again(finished_study):
    from service.orchestration.study_run import run_study

    study, explore, exploit = finished_study
    rows = explore + exploit
    before = {r["trial_name"]: kept_checkpoints(study, r["trial_name"]) for r in rows}
    again = run_study(study)
    after = {r["trial_name"]: kept_checkpoints(study, r["trial_name"]) for r in again}
    assert before == after
    assert {r["trial_name"]: r["best_metric"] for r in again} == {
        r["trial_name"]: r["best_metric"] for r in rows
    }


def test_the_trial_table_not_tunes_state_says_which_trials_are_done(finished_study):
    """Tune snapshots its experiment state every few seconds, so after a driver is killed it can
    lag the trial table; a rerun must go by the table. With Tune's state gone altogether, no
    trial starts again (every start rewrites the trial's topology.json)."""
    import shutil

    from service.orchestration.study_run import run_study

    study, explore, exploit = finished_study
    names = [r["trial_name"] for r in explore + exploit]

    def topologies():
        out = {}
        for n in names:
            with open(os.path.join(study.study_uri, "trials", n, "topology.json")) as f:
                out[n] = f.read()
        return out

    before = topologies()
    shutil.rmtree(os.path.join(study.study_uri, "tune"))
    rows = run_study(study)
    assert topologies() == before
    assert sorted(r["trial_name"] for r in rows) == sorted(names)
    assert not os.path.exists(os.path.join(study.study_uri, "tune"))


def test_offline_eval_of_the_best_checkpoint_on_the_test_split(finished_study, digits_dir):
    from service.evaluation.offline import output_uri
    from service.orchestration.offline_eval import run_offline_eval

    study, rows, _ = finished_study
    best = min(rows, key=lambda r: r["best_metric"])
    run_offline_eval(best["best_checkpoint"], "test", study)
    out = output_uri(best["best_checkpoint"], "test")
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)

    state = checkpoint.load(best["best_checkpoint"])
    logits, y = digits_logits(state, digits_dir / "test")
    predicted = logits.argmax(1)
    table = pq.read_table(str(digits_dir / "test"))
    assert metrics["count"] == len(y)
    assert metrics["error"] == pytest.approx(float((predicted != y).mean()), abs=1e-12)
    assert [c["support"] for c in metrics["per_class"]] == np.bincount(y, minlength=10).tolist()

    preds = pq.read_table(os.path.join(out, "predictions.parquet")).to_pandas()
    assert sorted(preds["example_id"]) == sorted(table.column("example_id").to_numpy())
    assert float((preds["prediction"] != preds["label"]).mean()) == pytest.approx(metrics["error"])
    assert set(preds["split"]) == {"test"} and set(preds["step"]) == {state.step}


def test_round_two_extends_round_ones_best_for_longer(finished_study):
    study, explore, exploit = finished_study
    best = min(explore, key=lambda r: r["best_metric"])
    (extended,) = exploit
    assert extended["extended_from"] == best["trial_name"]
    hps = [k for k in best if k.startswith("hp/")]
    assert {k: extended[k] for k in hps} == {k: best[k] for k in hps}
    log = metrics_log(study, extended["trial_name"])
    assert log[-1]["step"] == 160 == extended["step"]
    # cosine keeps the base LR and stretches: the LR at each eval follows the 160-step curve.
    lr = best["hp/learning_rate"]
    for r in log:
        p = (r["step"] - 1 - 5) / (160 - 5)
        assert r["learning_rate"] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * p)), rel=1e-9)


def test_verdicts_are_saved_and_shown(finished_study):
    from service.analysis.verdicts import best_step_position

    study, explore, exploit = finished_study
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        summaries = json.load(f)
    assert [s["round"] for s in summaries] == ["explore", "exploit"]
    kinds = {v["kind"] for v in summaries[0]["verdicts"]}
    assert {"best_step_position", "boundary", "infeasible_region", "enough_trials"} <= kinds
    # With 2 trials the "enough trials?" check must warn (the playbook: too few to trust).
    enough = next(v for v in summaries[0]["verdicts"] if v["kind"] == "enough_trials")
    assert enough["severity"] == "warning"
    for row in explore + exploit:
        position = row["best_step"] / row["max_train_steps"]
        expected_ok = 0.1 < position <= 0.75
        assert (row["step_verdict"] == "ok") == expected_ok
        assert (
            best_step_position(row["trial_name"], row["best_step"], row["max_train_steps"]).is_warning
            != expected_ok
        )
    out = stored_status(study)
    assert "round explore: enough_trials:" in out.stdout


def test_playbook_eval_command_prints_metrics_and_per_class_counts(finished_study, digits_dir, capsys):
    from service.cli import main

    study, explore, _ = finished_study
    best = min(explore, key=lambda r: r["best_metric"])
    assert main(["eval", best["best_checkpoint"], "--split", "validation"]) == 0
    out = capsys.readouterr().out
    assert "validation/count: 270" in out
    support = np.bincount(pq.read_table(str(digits_dir / "validation")).column("label").to_numpy())
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(parts[1]) for parts in lines] == support.tolist()
    assert [float(parts[-1]) for parts in lines] == pytest.approx((1 / support).tolist(), rel=1e-3)
    assert main(["eval", str(digits_dir), "--split", "test"]) == 2  # not a checkpoint: one line, exit 2
    # (Ray's own log forwarding may add lines to this process's stderr; ours is exactly one.)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("playbook:")]
    assert errors == [f"playbook: error: {digits_dir}: no checkpoint there (no state.pt)"]
    # More workers than the cluster's 2 CPUs hold: refused at once (Ray Train waited for them
    # forever), nothing run or written.
    before = folder_state(study.study_uri)
    assert main(["eval", best["best_checkpoint"], "--split", "test", "--num-workers", "3"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("playbook:")]
    want = "playbook: error: --num-workers: 1 x 3 workers x 1 CPUs = 3 CPUs, but the Ray cluster has 2"
    assert errors == [want]
    assert folder_state(study.study_uri) == before


def test_a_round_runs_as_tune_runs_of_at_most_trials_per_tune_run(ray_cluster, digits_dir, tmp_path):
    """Tune keeps every trial of a run in the coordinator until the run ends, so a round runs
    as consecutive Tune runs of at most `trials_per_tune_run` trials: 3 trials by 2 are 2 Tune
    runs (Tune names a run's trial folders `<trainable>_<run id>_<index>`), the round's table
    is whole, and Tune keeps no per-trial log writers."""
    from service.orchestration.study_run import run_study

    study = make_study(
        digits_dir,
        tmp_path,
        name="in-tune-runs",
        training={"max_train_steps": 20, "eval_every_steps": 10},
        rounds=[{"name": "explore", "num_trials": 3, "trials_per_tune_run": 2}],
    )
    rows = run_study(study)
    assert sorted(r["trial_name"] for r in rows) == [f"explore-{i:04d}" for i in range(3)]
    assert all(r["status"] == "FINISHED" and r["step"] == 20 for r in rows)
    runs = {}
    tune_dir = os.path.join(study.study_uri, "tune", "explore")
    for d in os.listdir(tune_dir):
        if os.path.isdir(os.path.join(tune_dir, d)):
            run_id = d.split("_")[1]
            runs[run_id] = runs.get(run_id, 0) + 1
    assert sorted(runs.values()) == [1, 2]
    # Tune writes result.json per trial, and no TensorBoard writer (Ray keeps each one open in
    # the coordinator after its trial) nor CSV log.
    written = {f for _, _, files in os.walk(tune_dir) for f in files}
    assert "result.json" in written and "progress.csv" not in written
    assert not any(f.startswith("events.out.tfevents") for f in written)


def test_curve_verdicts_of_each_round_match_its_metrics_logs(finished_study):
    """The round's saved training-curve verdicts (overfitting, still improving) name exactly
    the trials a plain loop over their metrics logs finds, by the rules of docs/verdicts.md
    with the default thresholds."""
    from service.analysis.curves import KINDS

    study, explore, exploit = finished_study
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        summaries = json.load(f)
    for summary, rows in zip(summaries, (explore, exploit), strict=True):
        saved = {v["kind"]: v["message"] for v in summary["verdicts"]}
        expected = {"overfitting": [], "still_improving": []}
        for row in rows:
            log = metrics_log(study, row["trial_name"])
            val = [(h["step"], h["validation/loss"]) for h in log]
            train = {h["step"]: h["train/loss"] for h in log}
            first, best = val[0][1], min(v for _, v in val)
            best_step = max(s for s, v in val if v == best)
            last_step, last = val[-1]
            if last - best > 0.1 * (first - best) and train[last_step] < train[best_step]:
                expected["overfitting"].append(row["trial_name"])
            start = 0.75 * row["max_train_steps"]
            before = min(v for s, v in val if s <= start)
            tail = min(v for s, v in val if s > start)
            if before - tail > 0.05 * (first - best):
                expected["still_improving"].append(row["trial_name"])
        for kind, names in expected.items():
            assert (kind in saved) == bool(names), (kind, names, saved.get(kind))
            assert all(name in saved.get(kind, "") for name in names)
        assert ("training_curves" in saved) == (not any(k in saved for k in KINDS))


def test_the_other_curve_verdicts_and_the_clip_threshold_of_a_real_study(finished_study):
    """The rest of the curve verdicts name exactly the trials `plain_curve_kinds` finds in their
    metrics logs (none diverged), and each round's clip_threshold is the numpy 90th percentile
    of its best trial's logged gradient norms: these trials do not clip, and the loop logs the
    norms all the same (clipped fraction 0)."""
    from service.core.formatting import fmt

    study, explore, exploit = finished_study
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        summaries = json.load(f)
    for summary, rows in zip(summaries, (explore, exploit), strict=True):
        saved = {v["kind"]: v["message"] for v in summary["verdicts"]}
        logs = {r["trial_name"]: metrics_log(study, r["trial_name"]) for r in rows}
        found = {
            r["trial_name"]: plain_curve_kinds(logs[r["trial_name"]], r["max_train_steps"], r["best_step"])
            for r in rows
        }
        for kind in ("late_noise", "saturated_early", "training_loss_rising", "early_instability"):
            names = [n for n, kinds in found.items() if kind in kinds]
            assert (kind in saved) == bool(names), (kind, names, saved.get(kind))
            assert all(name in saved.get(kind, "") for name in names)
        best = min(rows, key=lambda r: (r["best_metric"], r["trial_name"]))["trial_name"]
        norms = [h["train/grad_norm"] for h in logs[best]]
        assert all(h["train/clipped_fraction"] == 0 for h in logs[best]) and all(n > 0 for n in norms)
        assert saved["clip_threshold"].startswith(
            f"Suggested grad_clip_norm: {fmt(float(np.percentile(norms, 90)))}, the 90th percentile of "
            f"the best trial {best}'s {len(norms)} logged"
        )


def test_the_report_of_a_real_study_tags_each_trial_with_its_curve_verdicts(finished_study, tmp_path):
    """In headless Chromium at 1280 px: the real study's report fits the width, and each trial's
    row carries a 'still improving' tag exactly when the round's saved verdict names it."""
    from service import report
    from tests.helpers.chromium import check_page

    study, explore, exploit = finished_study
    out = tmp_path / "report.html"
    report.write(report.load(study.study_uri), str(out))
    rows_tags = """(() => Object.fromEntries([...document.querySelectorAll('table.trials tbody tr')].map(
      r => [r.cells[0].textContent, [...r.querySelectorAll('summary')].map(s => s.textContent)])))()"""
    page = check_page(str(out), evaluate=("document.documentElement.scrollWidth", rows_tags))
    width, tags = page.values
    assert page.console_errors == [] and width <= 1280
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        named = " ".join(
            v["message"] for s in json.load(f) for v in s["verdicts"] if v["kind"] == "still_improving"
        )
    assert set(tags) == {r["trial_name"] for r in explore + exploit}
    for name, labels in tags.items():
        assert ("still improving" in labels) == (name in named), (name, labels)
