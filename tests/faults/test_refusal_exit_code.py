"""A one-line refusal ends with exit code 2, every time: a `playbook next` refused right after
the stored trial table was read (its appended round has not run) exited 134 in about one run
of four (`terminate called without an active exception`) while `pq.read_table`'s dataset
reader, used on the trial table's bytes, left work on Arrow's threads for the interpreter's exit.
The table is now read on the calling thread (`core.tables.read_parquet`). Run from the user's
folder with the installed command, several times: with the old reader this fails almost surely
(0.75 ** 8 ~ 10% chance of passing)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.next_round import stored_study

PLAYBOOK = os.path.join(os.path.dirname(sys.executable), "playbook")
RUNS = 8


def test_a_refusal_after_reading_the_trial_table_exits_2_every_time(tmp_path):
    path = stored_study(tmp_path)
    with open(path, "a") as f:
        f.write("- {name: explore-2, num_trials: 8, seed: 1}\n")  # appended, not run
    codes, errors = [], set()
    for _ in range(RUNS):
        out = subprocess.run([PLAYBOOK, "next", "study.yaml"], cwd=tmp_path, capture_output=True, text=True)
        codes.append(out.returncode)
        errors.add(out.stderr)
    assert codes == [2] * RUNS, codes
    assert errors == {
        "playbook: error: rounds[1]: round explore-2 has not run yet: run the study, then ask for the next\n"
    }
