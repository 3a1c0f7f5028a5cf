"""Every command the README and docs/*.md show works from a fresh copy of the tree.

The command lines are collected from the docs (shell code blocks: lines that start with a
command; inline code that starts with `playbook`, `make`, `ray job submit` or `python -m`) and
must be exactly the keys of DOCUMENTED, which says how each one is checked: a line the docs gain
or lose fails here until the list says how it is accounted for. Then, from a copy of the files
git tracks (outside this folder, with this virtualenv; what a `git clone` has):

- `playbook --help` and each subcommand's; every documented `playbook SUB ...` names a real
  subcommand and only options its `--help` lists;
- every `make` target the docs name exists, and each Makefile entry point (`$(PY) -m MODULE`,
  `playbook SUB`) answers `--help` with the options the Makefile passes it;
- every documented `python -m MODULE` answers `--help` (or is run, where marked RUN);
- the lines marked RUN are run as written (`playbook validate` of every file in studies/, the
  built-in data sets, preprocessing, the tabular example's data and `validate --data`);
- a line too long to run here names the test that runs it (checked to exist)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.timeout(300)
REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent

FORM = "form"
"""Checked for its form only: the subcommand, make target or module exists, with these options."""
RUN = "run"
"""Run from the copy as written (see `test_the_runnable_commands_work_from_a_copy`)."""
NOT_A_COMMAND = "not a command"
"""A shell setting (`cd`, `export`) shown with the commands it goes with."""

REAL_HOSTS = "tests/cluster/test_real_hosts.py::test_make_real_hosts_runs_from_a_clean_working_directory"
JOB_SUBMIT = "tests/cluster/test_job_submit.py::test_job_submit_runs_the_study"
RELIABILITY_COUNTS = "tests/faults/test_bad_input_corpus.py::test_the_reliability_doc_counts_this_corpus"
DOCUMENTED = {
    "cd studies/tabular": NOT_A_COMMAND,
    "cd studies/tabular && playbook run study.yaml": (
        "tests/cluster/test_own_workload_study.py::test_a_study_on_a_workload_of_ones_own_from_validate_to_eval"
    ),
    "export RAY_GRAFANA_HOST=http://GRAFANA:3000": NOT_A_COMMAND,
    "export RAY_GRAFANA_IFRAME_HOST=http://GRAFANA:3000": NOT_A_COMMAND,
    "export RAY_PROMETHEUS_HOST=http://127.0.0.1:9090": NOT_A_COMMAND,
    "export RAY_PROMETHEUS_NAME=Prometheus": NOT_A_COMMAND,
    "prometheus --config.file=deploy/prometheus/prometheus.yml": (
        "tests/cluster/test_grafana_prometheus.py::test_every_panel_query_answers_what_the_study_recorded"
    ),
    "make": FORM,
    "make bench": FORM,
    "make bench-cluster": FORM,
    "make bench-scale": FORM,
    "make chaos": FORM,
    "make chromium": FORM,
    "make demo": FORM,
    "make lint": FORM,
    "make prometheus": FORM,
    "make real-hosts": REAL_HOSTS,
    "make test": FORM,
    "make test-cluster": FORM,
    "make test-fast": FORM,
    "playbook": FORM,
    "playbook ...": FORM,
    "playbook data": FORM,
    "playbook data KIND URI [--count N] [--seed S]": FORM,
    "playbook data images .images/data": RUN,
    "playbook data text .lm/data --max-bytes 2000000 --seq-len 128": RUN,
    "playbook demo --verbose": FORM,
    "playbook demo [--verbose]": FORM,
    "playbook eval": FORM,
    "playbook eval <best checkpoint> --split test": (
        "tests/cluster/test_own_workload_study.py::test_a_study_on_a_workload_of_ones_own_from_validate_to_eval"
    ),
    "playbook eval CHECKPOINT [--split test] [--num-workers N]": FORM,
    "playbook eval CHECKPOINT_URI [--split test] [--num-workers N]": FORM,
    "playbook export": FORM,
    "playbook export CHECKPOINT_URI --out FILE [--format torch|safetensors]": FORM,
    "playbook find-batch-size": FORM,
    "playbook find-batch-size STUDY.yaml [--max N] [--steps N] [--out PATH]": FORM,
    "playbook find-batch-size STUDY.yaml [--min 8] [--max 1024] [--steps 20] [--min-gain 0.1] [--out PATH]": (
        FORM
    ),
    "playbook find-steps": FORM,
    "playbook find-steps STUDY.yaml": FORM,
    "playbook next": FORM,
    "playbook next --append": FORM,
    "playbook next STUDY.yaml": FORM,
    "playbook next STUDY.yaml [--append]": FORM,
    "playbook preprocess": FORM,
    "playbook preprocess --workload": FORM,
    "playbook preprocess --workload module:Class": FORM,
    "playbook preprocess .images/data/train .images/decoded/train --workload images_decoded": RUN,
    "playbook preprocess .images/data/validation .images/decoded/validation --workload images_decoded": RUN,
    "playbook preprocess SOURCE DEST --workload W [--num-files N] [--row-group-size R]": FORM,
    "playbook preprocess SRC DEST --workload images_decoded": FORM,
    "playbook report": FORM,
    "playbook report STUDY.yaml|STUDY_URI [--out PATH]": FORM,
    "playbook report STUDY_URI_OR_FILE [--out PATH]": FORM,
    "playbook report study.yaml": (
        "tests/cluster/test_own_workload_study.py::test_a_study_on_a_workload_of_ones_own_from_validate_to_eval"
    ),
    "playbook run": FORM,
    "playbook run --verbose": FORM,
    "playbook run STUDY.yaml": FORM,
    "playbook run STUDY.yaml [--storage URI] [--verbose] [--dry-run]": FORM,
    "playbook run STUDY.yaml --dry-run": "tests/ray/test_dry_run.py",
    "playbook run --dry-run": FORM,
    "playbook run studies/digits-demo.yaml": FORM,
    "playbook run studies/images.yaml": FORM,
    "playbook run studies/lm.yaml": FORM,
    "playbook run studies/tabular/study.yaml": FORM,
    "playbook run study.yaml": (
        "tests/cluster/test_own_workload_study.py::test_a_study_on_a_workload_of_ones_own_from_validate_to_eval"
    ),
    "playbook status": FORM,
    "playbook status ... | head": FORM,
    "playbook status STUDY.yaml|STUDY_URI|NAME [--storage URI]": FORM,
    "playbook status study.yaml": (
        "tests/cluster/test_own_workload_study.py::test_a_study_on_a_workload_of_ones_own_from_validate_to_eval"
    ),
    "playbook studies": FORM,
    "playbook studies --storage URI": FORM,
    "playbook studies [--storage URI]": FORM,
    "playbook validate": FORM,
    "playbook validate --data": FORM,
    "playbook validate --data study.yaml": RUN,
    "playbook validate STUDY.yaml": RUN,
    "playbook validate STUDY.yaml [--data]": FORM,
    "playbook validate study.yaml --data": RUN,
    "python -m bench.gpu": FORM,
    "python -m bench.run --only cluster": FORM,
    "python -m bench.run --only scale": FORM,
    "python -m bench.table": RUN,
    "python -m service": FORM,
    "python -m service ...": FORM,
    "python -m tests.helpers.chaos": FORM,
    "python -m tests.helpers.reliability_counts": RELIABILITY_COUNTS,
    "python -m tests.helpers.reliability_counts --write": RELIABILITY_COUNTS,
    "python write_data.py data": RUN,
    "ray job submit --address": JOB_SUBMIT,
    "ray job submit --address http://HEAD:8265 --working-dir . -- playbook run studies/digits-demo.yaml": (
        JOB_SUBMIT
    ),
    "ray job submit --address http://HEAD:8265 --working-dir . -- playbook run studies/tabular/study.yaml": (
        "tests/cluster/test_own_workload_study.py::test_ray_job_submit_imports_the_workload_beside_a_study_in_a_subfolder"
    ),
    "ray job submit ... -- playbook run": JOB_SUBMIT,
    "ray job submit ... -- playbook run STUDY.yaml": JOB_SUBMIT,
}

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
BLOCK_COMMAND = re.compile(r"^(playbook|make|ray|python3?|cd|export|prometheus|kubectl|docker)\b")
INLINE_COMMAND = re.compile(r"^(playbook|make|ray job submit|python3? -m) ")
MAKE_ENTRY = re.compile(r"^\t\$\(PY\) -m ([\w.]+)(.*)$|^\t\$\(VENV\)/bin/playbook (\S+)(.*)$")


def make_entry_points(makefile: str) -> list[tuple]:
    """(module, its arguments, None, None) for each `$(PY) -m MODULE ...` a target's recipe
    runs, (None, None, subcommand, its arguments) for each `playbook SUB ...`; the virtualenv's
    own set-up (pip) left out."""
    found, target = [], None
    for line in makefile.splitlines():
        if head := re.match(r"^(\S+):", line):
            target = head[1]
        elif target != "$(STAMP)" and (m := MAKE_ENTRY.match(line)):
            found.append(m.groups())
    assert found, "no entry point found in the Makefile"
    return found


def doc_files() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented() -> dict[str, set[str]]:
    """Each documented command line (comment dropped, spaces collapsed, a table's `\\|` as `|`)
    -> the files that show it."""
    found: dict[str, set[str]] = {}

    def add(command: str, path: pathlib.Path) -> None:
        command = " ".join(command.replace("\\|", "|").split())
        found.setdefault(command, set()).add(str(path.relative_to(REPO)))

    for path in doc_files():
        block = None  # the info string of the fenced block we are in
        for line in path.read_text().splitlines():
            fence = re.match(r"^\s*```(\S*)", line)
            if fence:
                block = fence.group(1) if block is None else None
            elif block is not None:
                if block in SHELL_BLOCKS and BLOCK_COMMAND.match(line):
                    add(line.split("  #")[0], path)
            else:
                for span in re.findall(r"`([^`]+)`", line):
                    if INLINE_COMMAND.match(span) or span in ("make", "playbook"):
                        add(span, path)
    return found


def test_every_documented_command_is_accounted_for():
    found = documented()
    new = sorted(set(found) - set(DOCUMENTED))
    gone = sorted(set(DOCUMENTED) - set(found))
    assert not new, "documented commands not in DOCUMENTED: " + "; ".join(
        f"{c!r} ({sorted(found[c])})" for c in new
    )
    assert not gone, f"in DOCUMENTED, no longer in the docs: {gone}"
    for command, how in DOCUMENTED.items():
        if "::" in how:  # the test that runs it exists
            path, name = how.split("::")
            assert f"def {name}(" in (REPO / path).read_text(), (command, how)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> pathlib.Path:
    """The files git tracks (as a clone has them: no virtualenv, data or .demo) in a folder
    outside the repository."""
    root = tmp_path_factory.mktemp("clone") / "playbook"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def env_of(root: pathlib.Path) -> dict:
    """This virtualenv first on PATH, and the copy's packages imported before the installed
    (editable) ones, which point at this repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(root)}


def sh(root: pathlib.Path, command: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """`command` in a shell, in `cwd` (the copy's root by default); fails the test on a
    non-zero exit, with its output."""
    done = subprocess.run(
        command, shell=True, cwd=cwd or root, env=env_of(root), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (
        f"{command} (in {cwd or root}) exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )
    assert "Traceback" not in done.stdout + done.stderr, command
    return done


def subcommands(usage: str) -> list[str]:
    """The subcommands `playbook --help` lists (under its positional arguments)."""
    listed = usage.split("positional arguments:")[1].split("options:")[0]
    return re.findall(r"^    (\S+)", listed, re.M)


def options_of(command: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command)


def test_every_help_and_documented_form_works_from_a_copy(copy):
    assert sh(copy, "python -c 'import service; print(service.__file__)'").stdout.startswith(str(copy))
    usage = sh(copy, "playbook --help").stdout
    subs = subcommands(usage)
    assert "run" in subs and "validate" in subs, usage
    for s in subs:  # the summary line names every subcommand too
        assert re.search(rf"[\s|`]{re.escape(s)}[\s|.]", usage.split("positional arguments")[0]), s
    makefile = (REPO / "Makefile").read_text()
    entries = make_entry_points(makefile)
    modules = {c.split()[2] for c, how in DOCUMENTED.items() if c.startswith("python -m ") and how == FORM}
    modules |= {e[0] for e in entries if e[0]}
    helps = [f"playbook {s} --help" for s in subs] + [f"python -m {m} --help" for m in sorted(modules)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        said = dict(zip(helps, pool.map(lambda c: sh(copy, c).stdout, helps), strict=True))

    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for command, how in DOCUMENTED.items():
        words = command.split()
        if words[0] == "playbook" and len(words) > 1 and words[1] != "...":
            assert words[1] in subs, command
            for option in options_of(command):
                assert option in said[f"playbook {words[1]} --help"], (command, option)
        elif words[0] == "make" and len(words) > 1:
            assert words[1] in targets, command
        elif command.startswith("python -m ") and how == FORM:
            for option in options_of(command):
                assert option in said[f"python -m {words[2]} --help"], (command, option)
            for value in re.findall(r"--only (\w+)", command):
                assert value in said[f"python -m {words[2]} --help"], (command, value)
    for module, args, playbook_sub, playbook_args in entries:  # what each make target runs
        text = said[f"python -m {module} --help"] if module else said[f"playbook {playbook_sub} --help"]
        for option in options_of(args or playbook_args or ""):
            assert option in text, (module or playbook_sub, option)
        for value in re.findall(r"--only (\w+)", args or ""):
            assert value in text, (module, value)


def test_the_runnable_commands_work_from_a_copy(copy, tmp_path):
    """The RUN lines, as the docs show them, from the copy (the images data set smaller:
    `--count`, which the same line documents)."""
    studies = sorted((copy / "studies").rglob("*.yaml"))
    assert len(studies) >= 6, studies

    def validate(study):
        said = sh(copy, f"playbook validate {study.relative_to(copy)}").stdout
        assert said.startswith("ok: study "), (study, said)

    def data_sets():
        sh(copy, "playbook data text .lm/data --max-bytes 2000000 --seq-len 128")
        sh(copy, "playbook data images .images/data --count 300")
        for split in ("train", "validation"):
            sh(
                copy,
                f"playbook preprocess .images/data/{split} .images/decoded/{split} --workload images_decoded",
            )
            assert list((copy / ".images/decoded" / split).glob("*.parquet")), split

    def tabular_example():
        tabular = copy / "studies" / "tabular"
        sh(copy, "python write_data.py data", cwd=tabular)
        assert sh(copy, "playbook validate --data study.yaml", cwd=tabular).stdout.startswith("ok: ")
        assert sh(copy, "playbook validate study.yaml --data", cwd=tabular).stdout.startswith("ok: ")

    def bench_table():
        before = (copy / "docs" / "performance.md").read_bytes()
        sh(copy, "python -m bench.table")  # rewrites the generated table from results.json: the same
        assert (copy / "docs" / "performance.md").read_bytes() == before

    with ThreadPoolExecutor(max_workers=4) as pool:  # each waits on its processes, mostly
        for done in [pool.submit(data_sets), pool.submit(tabular_example), pool.submit(bench_table)] + [
            pool.submit(validate, s) for s in studies
        ]:
            done.result()
