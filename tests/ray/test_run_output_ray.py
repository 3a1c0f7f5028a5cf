"""What `playbook run` prints, from the user's side (the command run with its output in pipes,
as in a job log, on the shared cluster): one line per event (a round planned, a trial started,
evaluated, finished), each round's verdicts once, in order, then the trial table; none of Tune's
configuration boxes or "Wrote the latest version" records, no "(Coordinator pid=N)" prefix, no
ANSI escape, no live table. A rerun of the finished study says each round's verdicts once more,
once. With `--verbose`, Tune's own output is back. On a pseudo-terminal, the live table of the
running trials is drawn below the same lines and gone at the end."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pyarrow.parquet as pq
import pytest
import yaml

from service.analysis.report_lines import log_lines
from service.core.formatting import fmt
from tests.helpers.playbook_process import SERVICE_ROOT
from tests.helpers.studies import study_dict

pytestmark = pytest.mark.ray
TUNE_BOX = ("╭", "│", "╰")
TABLE_HEADER = re.compile(r"^trial\s+round\s+step\s+validation/loss\s+best\s+ETA$")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_env(ray_cluster) -> dict:
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    for name in ("RAY_COLOR_PREFIX", "COLUMNS", "LINES"):
        env.pop(name, None)
    return {**env, "PYTHONPATH": SERVICE_ROOT}


def playbook_run(ray_cluster, study_file, *flags) -> subprocess.CompletedProcess:
    """`playbook run` on the shared cluster, stdout and stderr in pipes (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "service", "run", str(study_file), *flags],
        cwd=os.path.dirname(study_file),
        env=run_env(ray_cluster),
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
    exploit_planned = lines.index("round exploit: 1 trial, at most 2 at once")
    assert explore_planned < at_explore < exploit_planned < at_exploit
    assert not [x for x in lines if TABLE_HEADER.match(x)]  # no live table in a pipe
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


def run_on_a_terminal(ray_cluster, study_file, timeout_s: float = 600) -> tuple[int, str]:
    """`playbook run` with stdin, stdout and stderr on a pseudo-terminal 120 columns wide: its
    exit code and all it wrote (the terminal's CR LF as LF)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "run", str(study_file)],
        cwd=os.path.dirname(study_file),
        env=run_env(ray_cluster),
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer of the terminal has closed it
                    break
                if not data:
                    break
                chunks.append(data)
        return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    finally:
        proc.kill()
        os.close(master)


def test_on_a_terminal_a_live_table_of_the_running_trials_is_drawn_below_the_lines(
    ray_cluster, digits_dir, tmp_path
):
    raw = study_dict(
        digits_dir, tmp_path / "storage", name="live", rounds=[{"name": "explore", "num_trials": 2}]
    )
    raw["training"].update(max_train_steps=200, eval_every_steps=50)
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    code, text = run_on_a_terminal(ray_cluster, str(study_file))
    assert code == 0, text[-3000:]
    assert "\x1b[J" in text  # the table erased before each new line, drawn again below it
    lines = ANSI.sub("", text).split("\n")
    headers = [i for i, x in enumerate(lines) if TABLE_HEADER.match(x)]
    assert headers, text[-3000:]
    rows = [x for x in lines if re.match(r"^explore-000[01]\s+explore\s+\d+/200\s", x)]
    assert rows, text[-3000:]
    final = next(i for i, x in enumerate(lines) if x.startswith("trial_name "))
    for name in ("explore-0000", "explore-0001"):  # the same event lines as in a pipe
        assert sum(x.startswith(f"[{name}] started: 200 steps, ") for x in lines) == 1
        assert sum(x.startswith(f"[{name}] finished: best validation/loss=") for x in lines) == 1
    assert max(headers) < final  # drawn while the trials ran, not after the study
    # the last drawing was erased before the study's verdicts and the command's own table
    last_drawn = [m.start() for m in re.finditer(r"trial\s+round\s+step\s", text)][-1]
    verdicts = text.index("round explore: The best trial is")
    assert last_drawn < text.rindex("\x1b[J", 0, verdicts) < verdicts < text.index("trial_name ")
