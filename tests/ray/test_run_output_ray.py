"""What `playbook run` prints, from the user's side (the command run with its output in pipes,
as in a job log, on the shared cluster): one line per event (a round planned, a trial started,
evaluated, finished), each round's verdicts once, in order, then the trial table; none of Tune's
configuration boxes or "Wrote the latest version" records, no "(Coordinator pid=N)" prefix, no
ANSI escape. A rerun of the finished study says each round's verdicts once more, once. With
`--verbose`, Tune's own output is back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from service.analysis.report_lines import log_lines
from service.core.formatting import fmt
from tests.helpers.playbook_process import SERVICE_ROOT
from tests.helpers.studies import study_dict

pytestmark = pytest.mark.ray
TUNE_BOX = ("╭", "│", "╰")


def playbook_run(ray_cluster, study_file, *flags) -> subprocess.CompletedProcess:
    """`playbook run` on the shared cluster, stdout and stderr in pipes (not a terminal)."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    env.pop("RAY_COLOR_PREFIX", None)
    env["PYTHONPATH"] = SERVICE_ROOT
    return subprocess.run(
        [sys.executable, "-m", "service", "run", str(study_file), *flags],
        cwd=os.path.dirname(study_file),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def write_study(digits_dir, folder, name, rounds) -> str:
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study_dict(digits_dir, folder / "storage", name=name, rounds=rounds)))
    return str(path)


def verdict_blocks(study_uri: str) -> list[list[str]]:
    """Each round's verdict lines, from the study's saved verdicts.json."""
    with open(os.path.join(study_uri, "verdicts.json")) as f:
        return [log_lines(summary) for summary in json.load(f)]


def no_noise(run: subprocess.CompletedProcess) -> None:
    both = run.stdout + run.stderr
    assert not [c for c in TUNE_BOX if c in both], both[-3000:]
    assert "Wrote the latest version" not in both
    assert "View detailed results here" not in both
    assert "\x1b[" not in both
    assert "(Coordinator pid=" not in both


def block_once(lines: list[str], block: list[str]) -> int:
    """Where `block` starts in `lines`, checking that each of its lines is there exactly once
    and that they are together, in order."""
    assert block
    for line in block:
        assert lines.count(line) == 1, (line, lines)
    start = lines.index(block[0])
    assert lines[start : start + len(block)] == block
    return start


def test_run_prints_one_line_per_event_and_each_round_verdicts_once(ray_cluster, digits_dir, tmp_path):
    rounds = [{"name": "explore", "num_trials": 2}, {"name": "exploit", "kind": "extend", "num_trials": 1}]
    study_file = write_study(digits_dir, tmp_path, "quiet", rounds)
    run = playbook_run(ray_cluster, study_file)
    assert run.returncode == 0, run.stderr[-3000:]
    no_noise(run)
    lines = run.stdout.splitlines()
    uri = str(tmp_path / "storage" / "quiet")
    rows = pq.read_table(os.path.join(uri, "trials.parquet")).to_pylist()
    assert len(rows) == 3
    for r in rows:
        name, steps = r["trial_name"], r["max_train_steps"]
        (started,) = [x for x in lines if x.startswith(f"[{name}] started: {steps} steps, learning_rate=")]
        last = f"[{name}] step {steps}/{steps} (100%) "
        assert sum(x.startswith(last) for x in lines) == 1
        finished = f"[{name}] finished: best validation/loss={fmt(r['best_metric'])} at step {r['best_step']}"
        assert lines.count(finished) == 1
        assert lines.index(started) < lines.index(finished)
    explore, exploit = verdict_blocks(uri)
    at_explore, at_exploit = block_once(lines, explore), block_once(lines, exploit)
    explore_planned = lines.index("round explore: 2 trials, at most 2 at once")
    exploit_planned = lines.index("round exploit: 1 trials, at most 2 at once")
    assert explore_planned < at_explore < exploit_planned < at_exploit
    table = next(i for i, x in enumerate(lines) if x.startswith("trial_name "))
    assert table > at_exploit + len(exploit) - 1  # the command's own lines come after the study's

    rerun = playbook_run(ray_cluster, study_file)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    no_noise(rerun)
    lines = rerun.stdout.splitlines()
    assert "round explore: resuming from " + uri + ": 2 of 2 trials already done" in lines
    assert not [x for x in lines if x.startswith("[")]  # no trial ran again
    for block in verdict_blocks(uri):
        block_once(lines, block)


def test_verbose_brings_tunes_own_output_back(ray_cluster, digits_dir, tmp_path):
    study_file = write_study(digits_dir, tmp_path, "verbose", [{"name": "explore", "num_trials": 1}])
    run = playbook_run(ray_cluster, study_file, "--verbose")
    assert run.returncode == 0, run.stderr[-3000:]
    both = run.stdout + run.stderr
    assert "Configuration for experiment" in both and "╭" in both
    assert "Wrote the latest version of all result files" in both
    assert "[explore-0000] finished: best validation/loss=" in run.stdout  # the study's lines too
