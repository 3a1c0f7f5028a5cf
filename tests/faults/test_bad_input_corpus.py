"""The bad-input corpus (cases in tests/helpers/bad_input_cases.py): each runs the `playbook` CLI on one
kind of bad input and must end with exit code 2, exactly one error line naming the field or file,
and nothing written. Spec value errors live in test_spec.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from service import cli
from tests.helpers.bad_input_cases import CASES, Case
from tests.helpers.flaky_storage import FlakyMemoryFS
from tests.helpers.processes import own_lines
from tests.helpers.studies import study_dict

VALID_CONTROLS = {"valid-control"}
BAD = [(n, fn) for n, fn in CASES if n not in VALID_CONTROLS]


def snapshot(*roots: str) -> dict:
    """Every folder, and every file with its size and modification time, under `roots`."""
    out = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            out.update({os.path.join(folder, d): "dir" for d in dirs})
            for name in files:
                st = os.lstat(os.path.join(folder, name))
                out[os.path.join(folder, name)] = (st.st_size, st.st_mtime_ns)
    return out


def prepare(name, fn, tmp_path, digits_dir) -> tuple[Case, list[str], str | None]:
    c = Case(str(tmp_path), str(digits_dir), study_dict(digits_dir, tmp_path / "storage"))
    c.study_file = str(tmp_path / "study.yaml")
    argv, expected = fn(c)
    if not os.path.isdir(c.study_file) and c.study_file == str(tmp_path / "study.yaml"):
        with open(c.study_file, "w") as f:
            f.write(c.raw if isinstance(c.raw, str) else "" if c.raw is None else yaml.safe_dump(c.raw))
    return c, argv, expected and expected.format(study=c.study_file)


@pytest.mark.parametrize("name,fn", BAD, ids=[n for n, _ in BAD])
def test_bad_input_is_refused_cleanly(name, fn, tmp_path, digits_dir, capsys, request):
    c, argv, expected = prepare(name, fn, tmp_path, digits_dir)
    if c.needs_ray:
        request.getfixturevalue("ray_cluster")
    before = snapshot(str(tmp_path), str(digits_dir))
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    finally:
        FlakyMemoryFS.fail_writes = 0
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert out == ""
    lines = own_lines(err)  # a traceback or a stray warning counts
    assert len(lines) == 1, err
    assert lines[0].startswith(f"playbook: error: {expected}"), lines[0]
    assert len(lines[0]) > len(f"playbook: error: {expected}: ") + 5  # says what is wrong
    assert snapshot(str(tmp_path), str(digits_dir)) == before  # nothing written, nothing removed
    assert not os.path.exists(c.path("pwned"))
    if isinstance(c.raw, dict) and c.storage.startswith("flaky://"):
        assert not FlakyMemoryFS.store


def test_the_valid_control_passes(tmp_path, digits_dir, capsys):
    """The corpus's one valid neighbour (so the checks do not refuse everything)."""
    (name,) = VALID_CONTROLS
    c, argv, _ = prepare(name, dict(CASES)[name], tmp_path, digits_dir)
    assert cli.main(argv) == 0, capsys.readouterr().err


SUBPROCESS_CASES = ["study-file-python-tag", "data-corrupt-file", "storage-is-a-file", "workload-unknown"]


def test_as_real_subprocesses(tmp_path_factory, digits_dir):
    """A few cases through `python -m service`: the exit code and stderr a shell sees."""
    procs = {}
    for name in SUBPROCESS_CASES:
        tmp = tmp_path_factory.mktemp(name)
        c, argv, expected = prepare(name, dict(CASES)[name], tmp, digits_dir)
        before = snapshot(str(tmp))
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs[name] = (proc, expected, tmp, before)
    for name, (proc, expected, tmp, before) in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err)
        assert out == "" and len(err.splitlines()) == 1, (name, err)
        assert err.startswith(f"playbook: error: {expected}"), (name, err)
        assert snapshot(str(tmp)) == before, name


def test_the_reliability_doc_counts_this_corpus():
    """The generated summary in docs/reliability.md is what `python -m tests.helpers.reliability_counts`
    prints now (rewrite it with `--write`)."""
    from tests.helpers.reliability_counts import DOC, counts, generated_block, summary_lines

    assert len(BAD) >= 40
    with open(DOC) as f:
        committed = generated_block(f.read())
    lines = summary_lines(counts())
    assert committed == "\n".join(lines), "\n".join(lines)
    assert any(line.endswith(f"nothing written): {len(BAD)}") for line in lines)
