"""`playbook next` from a user's folder with the installed command, on the session's Ray cluster:
a finished one-round study gets a proposal whose YAML parses and that `playbook validate`
accepts; `--append` writes it into the study file with every other byte kept; `playbook run`
then runs the appended round only (round 1's trial folders untouched); `playbook status` and
`playbook report` show the rounds as a chain with the reason; the refusals are one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from service.study import spec

PLAYBOOK = os.path.join(os.path.dirname(sys.executable), "playbook")
"""The installed command (the project's console script, beside the interpreter)."""

STUDY = """\
# A user's study: its comments and key order must survive `playbook next --append`.
name: nexty
workload: digits
data: {{train: {data}/train, validation: {data}/validation, test: {data}/test}}
storage: runs                     # relative: under the folder it runs from
training:
  max_train_steps: 40
  batch_size: 32
  eval_batch_size: 64
  eval_every_steps: 4             # the first evaluation inside the first 10%
  metric: validation/loss
  mode: min
  schedule: {{kind: cosine, warmup_steps: 5}}
search:
  learning_rate: {{role: fixed, value: 0.1}}
  momentum: {{role: fixed, value: 0.9}}
  width: {{role: scientific, type: choice, values: [4, 8]}}
rounds:
  - name: explore                 # round 1: two trials, too few to trust the best
    num_trials: 2
# the end of the file
"""


def playbook(*args, cwd, env, check_exit=0) -> subprocess.CompletedProcess:
    out = subprocess.run([PLAYBOOK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == check_exit, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return out


def refused(out: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refusal (exit 2)."""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("playbook: error: "), out.stderr
    return lines[0]


def test_next_proposes_and_appends_the_round_the_verdicts_call_for(ray_cluster, digits_dir, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    user = tmp_path / "user"
    user.mkdir()
    text = STUDY.format(data=digits_dir)
    (user / "study.yaml").write_text(text)

    # before the study has run: refused
    assert "has not run" in refused(playbook("next", "study.yaml", cwd=user, env=env, check_exit=2))

    playbook("run", "study.yaml", cwd=user, env=env)
    proposed = playbook("next", "study.yaml", cwd=user, env=env).stdout
    (item,) = yaml.safe_load(proposed)  # one list item, ready to go under rounds:
    assert item["name"] == "explore-2" and item["kind"] == "quasi_random"
    assert item["num_trials"] == 5 and item["seed"] == 1  # 2 finished (< 5): max(2 x 2, 5) trials
    assert "enough_trials: 2 finished" in item["reason"]
    assert "num_trials: 5" in proposed and "# enough_trials: 2 finished, fewer than 5" in proposed
    assert (user / "study.yaml").read_text() == text  # printing writes nothing

    by_hand = user / "by-hand.yaml"
    by_hand.write_text(text.replace("# the end of the file\n", proposed + "# the end of the file\n"))
    assert playbook("validate", str(by_hand), cwd=user, env=env).stdout.startswith(
        "ok: study nexty: 2 round(s)"
    )

    playbook("next", "study.yaml", "--append", cwd=user, env=env)
    appended = (user / "study.yaml").read_text()
    at = text.index("# the end of the file")
    assert appended == text[:at] + proposed + text[at:]  # byte for byte but the block
    rounds = spec.load_file(user / "study.yaml").rounds
    assert [r.name for r in rounds] == ["explore", "explore-2"] and rounds[1].num_trials == 5
    assert playbook("validate", "study.yaml", cwd=user, env=env).returncode == 0

    # the appended round has not run: no next one yet; another study's file: refused
    assert "rounds[1]: round explore-2 has not run yet" in refused(
        playbook("next", "study.yaml", cwd=user, env=env, check_exit=2)
    )
    other = user / "other.yaml"
    other.write_text(text.replace("max_train_steps: 40", "max_train_steps: 60"))
    line = refused(playbook("next", "other.yaml", cwd=user, env=env, check_exit=2))
    assert "not the file study 'nexty' ran" in line and "training.max_train_steps" in line

    # playbook run runs the appended round only: round 1's trial folders byte for byte, mtimes kept
    trials = user / "runs" / "nexty" / "trials"
    before = files_of(trials, "explore-0")
    playbook("run", "study.yaml", cwd=user, env=env)
    assert files_of(trials, "explore-0") == before and len(before) > 4
    names = [f"explore-000{i}" for i in range(2)] + [f"explore-2-000{i}" for i in range(5)]
    assert sorted(p.name for p in trials.iterdir()) == names

    reason = item["reason"]
    chain = (
        "rounds:\n  explore: quasi_random, 2 trials x 40 steps\n"
        "  explore-2: quasi_random, 5 trials x 40 steps; changed: trials 2 -> 5, seed 0 -> 1; "
        f"why: {reason}\n"
    )
    assert chain in playbook("status", "study.yaml", cwd=user, env=env).stdout
    report = playbook("report", "study.yaml", cwd=user, env=env)
    assert chain.split("\n", 1)[1] in report.stdout
    page = (user / "runs" / "nexty" / "report.html").read_text()
    assert "<h2>rounds</h2>" in page and "<td>explore</td><td>quasi_random</td><td>2 x 40</td>" in page
    assert "<td>trials 2 -&gt; 5, seed 0 -&gt; 1</td>" in page and f"<td>{reason}</td>" in page


def files_of(folder, prefix: str) -> dict:
    """Every file under `folder`'s subfolders named `prefix...`: (its bytes, its mtime in ns)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for sub in folder.iterdir()
        if sub.name.startswith(prefix)
        for p in sorted(sub.rglob("*"))
        if p.is_file()
    }
