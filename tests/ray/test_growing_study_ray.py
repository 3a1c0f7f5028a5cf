"""A study that grows round by round, from a user's folder with the installed command: a
1-round study runs; a round appended to its file by hand runs alone on `playbook run` (the
finished round's trial folders byte-identical, their mtimes unchanged, its verdicts as they
were); a third round with a widened learning-rate range runs and is judged in its own space;
an edit to a finished round is refused in one line, exit 2, nothing written. Also: a study
interrupted during an appended round finishes it on a rerun without rerunning its finished
trials."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest

from service.study import spec
from tests.helpers.one_worker_trials import committed_steps
from tests.helpers.studies import folder_state, free_cpus_after_study, study_dict

pytestmark = pytest.mark.ray
PLAYBOOK = os.path.join(os.path.dirname(sys.executable), "playbook")
"""The installed command (the project's console script, beside the interpreter)."""

STUDY = """\
name: grows
workload: digits
data: {{train: {data}/train, validation: {data}/validation}}
storage: runs
training:
  max_train_steps: 40
  batch_size: 32
  eval_batch_size: 64
  eval_every_steps: 20
  num_checkpoints_to_keep: 2
  metric: validation/loss
  schedule: {{kind: cosine, warmup_steps: 5}}
search:
  learning_rate: {{role: nuisance, type: float, min: 0.01, max: 0.5, scale: log}}
  momentum: {{role: nuisance, type: float, min: 0.5, max: 0.95}}
  width: {{role: fixed, value: 4}}
rounds:
  - {{name: explore, num_trials: 2}}
"""
ROUND_2 = "  - {name: longer, kind: extend, num_trials: 1}\n"
ROUND_3 = (
    "  - {name: wider, num_trials: 3, seed: 1,\n"
    "     search: {learning_rate: {role: nuisance, type: float, min: 0.01, max: 2.0, scale: log}}}\n"
)


def playbook(cwd, env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([PLAYBOOK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def trial_folders(study_uri: str, round_name: str) -> dict:
    trials = os.path.join(study_uri, "trials")
    names = sorted(n for n in os.listdir(trials) if n.startswith(f"{round_name}-"))
    assert names, round_name
    return {n: folder_state(os.path.join(trials, n)) for n in names}


def verdicts(study_uri: str) -> dict[str, dict]:
    with open(os.path.join(study_uri, "verdicts.json")) as f:
        return {s["round"]: s for s in json.load(f)}


def rows(study_uri: str) -> dict[str, dict]:
    table = pq.read_table(os.path.join(study_uri, "trials.parquet")).to_pylist()
    return {r["trial_name"]: r for r in table}


@pytest.fixture(scope="module")
def grown(ray_cluster, digits_dir, tmp_path_factory):
    user = tmp_path_factory.mktemp("user")
    study_file = user / "study.yaml"
    study_file.write_text(STUDY.format(data=digits_dir))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    uri = str(user / "runs" / "grows")
    out = {}
    out["run1"] = playbook(user, env, "run", "study.yaml")
    assert out["run1"].returncode == 0, out["run1"].stderr[-3000:]
    out["explore"], out["verdicts1"] = trial_folders(uri, "explore"), verdicts(uri)
    with open(study_file, "a") as f:  # round 2, appended by hand
        f.write(ROUND_2)
    out["run2"] = playbook(user, env, "run", "study.yaml")
    assert out["run2"].returncode == 0, out["run2"].stderr[-3000:]
    out["explore_after_2"], out["longer"] = trial_folders(uri, "explore"), trial_folders(uri, "longer")
    out["verdicts2"] = verdicts(uri)
    with open(study_file, "a") as f:  # round 3: the learning-rate range widened
        f.write(ROUND_3)
    out["run3"] = playbook(user, env, "run", "study.yaml")
    assert out["run3"].returncode == 0, out["run3"].stderr[-3000:]
    out["explore_after_3"], out["longer_after_3"] = (
        trial_folders(uri, "explore"),
        trial_folders(uri, "longer"),
    )
    return user, uri, env, out


def test_an_appended_round_runs_alone(grown):
    _, uri, _, out = grown
    table = rows(uri)
    assert sorted(table) == [
        "explore-0000", "explore-0001", "longer-0000", "wider-0000", "wider-0001", "wider-0002"
    ]  # fmt: skip
    assert all(r["status"] == "FINISHED" for r in table.values())
    assert "round explore: resuming from" in out["run2"].stdout
    assert "2 of 2 trials already done" in out["run2"].stdout
    assert "round longer: 1 trial," in out["run2"].stdout
    assert "round explore: 2 trials" not in out["run2"].stdout
    best = min(
        (table["explore-0000"], table["explore-0001"]), key=lambda r: (r["best_metric"], r["trial_name"])
    )
    assert table["longer-0000"]["extended_from"] == best["trial_name"]
    assert table["longer-0000"]["max_train_steps"] == 80


def test_finished_rounds_are_untouched_by_the_rounds_after_them(grown):
    """Every file and folder of round 1's trials byte-identical, with its mtime, after round 2
    and round 3 ran; round 2's after round 3; their verdicts as they were saved."""
    _, _, _, out = grown
    assert out["explore_after_2"] == out["explore"]
    assert out["explore_after_3"] == out["explore"]
    assert out["longer_after_3"] == out["longer"]
    assert out["verdicts2"]["explore"] == out["verdicts1"]["explore"]
    assert {k: out["verdicts2"][k] for k in ("explore", "longer")} == {
        k: verdicts(grown[1])[k] for k in ("explore", "longer")
    }


def test_the_third_round_searches_and_is_judged_in_its_widened_space(grown):
    """Its trials' learning rates lie in [0.01, 2.0]; its boundary verdict places the best one
    in that range: log(lr / 0.01) / log(200) (in the study's [0.01, 0.5] it would be over
    log(50))."""
    _, uri, _, _ = grown
    table = rows(uri)
    wider = [table[f"wider-000{i}"] for i in range(3)]
    assert all(0.01 <= r["hp/learning_rate"] <= 2.0 for r in wider)
    best = min(wider, key=lambda r: (r["best_metric"], r["trial_name"]))
    lr_verdicts = [
        v
        for v in verdicts(uri)["wider"]["verdicts"]
        if v["kind"] == "boundary" and v["subject"] == "learning_rate"
    ]
    position = math.log(best["hp/learning_rate"] / 0.01) / math.log(200)
    assert lr_verdicts, verdicts(uri)["wider"]
    assert f"at {position * 100:.3g}% of the log-scale range [0.01, 2]" in lr_verdicts[0]["message"]


def test_an_edit_to_a_finished_round_is_refused_in_one_line(grown):
    user, uri, env, _ = grown
    study_file = user / "study.yaml"
    text = study_file.read_text()
    stored = {p: folder_state(p) for p in (uri,)}
    study_file.write_text(text.replace("{name: explore, num_trials: 2}", "{name: explore, num_trials: 3}"))
    try:
        out = playbook(user, env, "run", "study.yaml")
    finally:
        study_file.write_text(text)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert "already exists" in line and "different rounds[0].num_trials;" in line
    assert {p: folder_state(p) for p in (uri,)} == stored  # nothing written


# ----------------------------------------------------------------------------- interrupted


def interrupted_study(digits_dir, storage, rounds) -> spec.Study:
    return spec.load_dict(
        study_dict(
            digits_dir,
            storage,
            name="grows-cut",
            training={"max_train_steps": 40, "eval_every_steps": 20, "num_checkpoints_to_keep": 1},
            rounds=rounds,
        )
    )


def test_a_study_interrupted_in_an_appended_round_finishes_it_on_a_rerun(ray_cluster, digits_dir, tmp_path):
    """The coordinator is killed (as when its driver dies) once the appended round's first trial
    is over and its second has a checkpoint; the rerun trains only what is left."""
    from service.orchestration.coordinator import actor_name
    from service.orchestration.ray_private import remove_orphaned_placement_groups
    from service.orchestration.study_run import run_study

    first = [{"name": "explore", "num_trials": 1}]
    run_study(interrupted_study(digits_dir, tmp_path, first))
    more = {"name": "more", "num_trials": 3, "max_concurrent_trials": 1, "max_train_steps": 600}
    study = interrupted_study(digits_dir, tmp_path, [*first, more])
    uri = study.study_uri
    explore = trial_folders(uri, "explore")

    thread = threading.Thread(target=lambda: _swallow(run_study, study), daemon=True)
    thread.start()
    deadline, at_kill = time.time() + 300, None
    while time.time() < deadline and at_kill is None:
        done = {n: r["status"] for n, r in _stored_rows(uri).items()}
        second = os.path.join(uri, "trials", "more-0001")
        committed = committed_steps(second)
        if done.get("more-0000") == "FINISHED" and committed and done.get("more-0001") != "FINISHED":
            ray_cluster.kill(ray_cluster.get_actor(actor_name(study.name)))
            at_kill = {
                "committed": committed,
                "first": folder_state(os.path.join(uri, "trials", "more-0000")),
            }
        time.sleep(0.05)
    thread.join(120)
    assert at_kill is not None, "the appended round was never caught with one trial done and one running"
    _wait_gone(ray_cluster, actor_name(study.name))
    # Its TuneRun's trial groups last as long as this session's driver: a playbook run would
    # have exited, and its job with it. Left, they would hold a CPU for every later test.
    remove_orphaned_placement_groups()
    assert _stored_rows(uri)["more-0001"]["status"] != "FINISHED"

    after = {r["trial_name"]: r for r in run_study(study)}
    assert sorted(after) == ["explore-0000", "more-0000", "more-0001", "more-0002"]
    assert all(r["status"] == "FINISHED" and r["step"] == r["max_train_steps"] for r in after.values())
    assert folder_state(os.path.join(uri, "trials", "more-0000")) == at_kill["first"]  # not rerun
    assert trial_folders(uri, "explore") == explore
    with open(os.path.join(uri, "trials", "more-0001", "topology.json")) as f:
        resumed = json.load(f)["ranks"][0]["resumed_from_step"]
    assert max(at_kill["committed"]) <= resumed < 600
    assert free_cpus_after_study() == ray_cluster.cluster_resources()["CPU"]  # nothing left holding one


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the killed coordinator's error: what the test does next is the point
        pass


def _stored_rows(uri: str) -> dict[str, dict]:
    try:
        return rows(uri)
    except (OSError, ValueError):
        return {}


def _wait_gone(ray, name: str) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        time.sleep(0.2)
    raise AssertionError(f"actor {name} still alive")
