"""A workload module of one's own that does not compile is bad input like one that does not
import: `playbook validate` says so in one line naming the module's file and line, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.helpers.studies import MINIMAL_STUDY


def test_a_workload_module_with_a_syntax_error_is_one_line_naming_its_file(tmp_path):
    (tmp_path / "broken_wl.py").write_text("class X:\n    def f(:\n        pass\n")
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({**MINIMAL_STUDY, "workload": "broken_wl:X"}))
    done = subprocess.run(
        [sys.executable, "-m", "service", "validate", str(tmp_path / "study.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "playbook: error: workload: cannot load 'broken_wl:X' (invalid syntax (broken_wl.py, line 2)); "
        "a module of your own is imported from the study file's folder or the working directory "
        "(docs/workloads.md)"
    ]
