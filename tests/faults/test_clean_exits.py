"""The CLI's exits as a shell sees them: `validate --data` exits 0 on every run (no abort of an
Arrow thread at exit), output into a closed pipe ends without a traceback, and a successful
run's driver output holds no traceback or warning that is not the user's problem."""

from __future__ import annotations

import gc
import io
import os
import re
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pyarrow.parquet as pq
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem

from service.cli.prepare import TRAIN_POLL_ENV, TRAIN_POLL_S
from service.study import spec
from service.tracking.trial_table import TrialTable
from tests.helpers.processes import EnvironWatcher
from tests.helpers.studies import TRIAL_LAYOUTS, study_dict

RAY_LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+ [EWF] \d+ \d+\] \S+:\d+: ")
"""A line of Ray's own C++ log (`[2026-12-06 22:42:55,407 E 22546 22606] core_worker.cc:2465: ...`)
at error, warning or fatal level, as Ray forwards it from one of its processes."""
VALIDATE_RUNS = 30
AT_ONCE = 3  # runs side by side: a loaded machine is where the abort showed (1 run in 7)


def cli_env() -> dict:
    """This environment without RAY_ADDRESS: a `playbook run` starts its own local Ray."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def playbook(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        timeout=600,
        **kw,
    )


def test_validate_data_exits_0_on_every_run(digits_dir, tmp_path):
    """Each run reads parquet through Python file objects; an Arrow pool thread that dropped
    the last reference to one of their buffers while the interpreter exited aborted the
    process (`terminate called without an active exception`, exit 134)."""
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(study_dict(digits_dir, tmp_path / "storage")))
    with ThreadPoolExecutor(AT_ONCE) as pool:
        runs = list(pool.map(lambda _: playbook("validate", "--data", str(study_file)), range(VALIDATE_RUNS)))
    failed = [(r.returncode, r.stderr[-300:]) for r in runs if r.returncode != 0 or "terminate" in r.stderr]
    assert not failed, failed
    assert all(r.stdout.startswith("ok: study t:") for r in runs)


class TrackedBytes(bytearray):
    """Bytes a read returned; records the thread that drops the last reference to them."""

    created = 0
    released: list[int] = []

    def __init__(self, data):
        super().__init__(data)
        TrackedBytes.created += 1

    def __del__(self):
        TrackedBytes.released.append(threading.get_ident())


class TrackedFile(io.RawIOBase):
    def __init__(self, data: bytes):
        self.f = io.BytesIO(data)

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, *args):
        return self.f.seek(*args)

    def tell(self):
        return self.f.tell()

    def read(self, n=-1):
        return TrackedBytes(self.f.read(n))


class TrackedFS(MemoryFileSystem):
    """Remote-like storage (a Python file object per open) whose reads return TrackedBytes."""

    protocol = "tracked"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("tracked://"))

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            return TrackedFile(self.cat_file(path))
        return super()._open(path, mode, **kwargs)


def test_validate_data_drops_every_python_buffer_on_the_calling_thread(digits_dir, tmp_path, capsys):
    """The cause of the abort, made visible: every buffer a parquet read got from a Python file
    object is released on the thread that read, before the command returns (none is left for
    an Arrow thread to drop while the interpreter exits)."""
    fsspec.register_implementation("tracked", TrackedFS, clobber=True)
    TrackedFS.store.clear()
    fs = fsspec.filesystem("tracked")
    for split in ("train", "validation", "test"):
        for name in sorted(os.listdir(digits_dir / split)):
            fs.pipe_file(f"/d/{split}/{name}", (digits_dir / split / name).read_bytes())
    raw = study_dict(digits_dir, tmp_path / "storage")
    raw["data"] = {split: f"tracked:///d/{split}" for split in ("train", "validation", "test")}
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    TrackedBytes.created, TrackedBytes.released = 0, []
    from service import cli

    for _ in range(10):  # which thread drops a buffer is a race: ten tries show it
        assert cli.main(["validate", "--data", str(study_file)]) == 0, capsys.readouterr().err
    gc.collect()
    main = threading.get_ident()
    assert TrackedBytes.created > 0
    assert len(TrackedBytes.released) == TrackedBytes.created  # none still held
    assert set(TrackedBytes.released) == {main}


def stored_study(digits_dir, tmp_path) -> str:
    """A study folder with its study.yaml and a trial table of 200 rows (more output than a
    reader of its first lines takes)."""
    study = spec.load_dict(study_dict(digits_dir, tmp_path / "storage", name="piped"))
    os.makedirs(study.study_uri)
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    table = TrialTable(study.study_uri, study.training.metric, study.training.mode)
    for i in range(200):
        table.update(f"explore-{i:04d}", status="FINISHED", step=40, best_metric=1.0 / (i + 1), best_step=40)
    table.save()
    return study.study_uri


def test_status_into_a_closed_pipe_exits_without_a_traceback(digits_dir, tmp_path):
    """`playbook status ... | head`: the reader is gone before the table is written."""
    study_uri = stored_study(digits_dir, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "status", study_uri],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    proc.stdout.close()  # as `head` does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, err
    assert err == "", err
    # The same command into a pipe that is read: the whole table, exit 0.
    out = playbook("status", study_uri)
    assert out.returncode == 0 and "explore-0199" in out.stdout, out.stderr


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["pool", "ray-train"])
def test_a_successful_run_prints_no_traceback_or_warning(ray_cluster, digits_dir, tmp_path, layout):
    """A 2-worker study run by the CLI with its own local Ray while another Ray (this test session's)
    runs on the machine, on a pool of reused workers (the default) and as a Ray Train run
    (`reuse_workers: false`), then (once) `playbook eval` of its checkpoint the same way: Ray
    Train's placement-group cleaner found two and printed tracebacks, every worker printed torch's
    `broadcast_buffers` FutureWarning and DDP's notice that it found no unused parameters, and Ray
    warned on every run that it had turned token authentication on (as it still does), and Ray core
    logged an error line for the actor Ray Train's controller starts to watch for preemption
    (ray-project/ray#53727). A Ray Train trial's controller polls its workers at the service's
    interval, not Ray's 2 s (a report waits for the poll: every evaluation waited for it); a pooled
    trial starts no controller."""
    raw = study_dict(
        digits_dir,
        tmp_path / "storage",
        name="quiet",
        scaling={**TRIAL_LAYOUTS[layout], "cpus_per_worker": 0.5},
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    # As on a user's machine: the poll interval is the service's (this session's is not), and
    # no RAY_AUTH_MODE (this session's Ray set one), where Ray's default warned on every run.
    env = {k: v for k, v in cli_env().items() if k not in (TRAIN_POLL_ENV, "RAY_AUTH_MODE")}
    # The controllers of this command's own Ray, not of another on the machine (its processes
    # inherit the command's environment).
    tag = {"PLAYBOOK_TEST_RUN": uuid.uuid4().hex}
    env.update(tag)
    with EnvironWatcher("TrainController", only_env=tag) as controllers:
        out = playbook("run", str(study_file), cwd=str(tmp_path), env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "best trial: explore-0000" in out.stdout
    for noise in ("Traceback", "WARNING", "Warning", "Exception ignored", "Error"):
        assert noise not in text, text[-4000:]
    assert not RAY_LOG_LINE.search(text), text[-4000:]
    intervals = [e.get(TRAIN_POLL_ENV) for e in controllers.seen.values()]
    assert intervals == ([TRAIN_POLL_S] if layout == "ray-train" else [])
    if layout == "pool":  # `playbook eval` (a Ray Train run) of its checkpoint, beside the same other Ray
        (row,) = pq.read_table(tmp_path / "storage" / "quiet" / "trials.parquet").to_pylist()
        out = playbook("eval", row["best_checkpoint"], "--split", "validation", cwd=str(tmp_path), env=env)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "validation/count: 270" in out.stdout, text[-4000:]
        for noise in ("Traceback", "WARNING", "Warning", "Exception ignored", "Error"):
            assert noise not in text, text[-4000:]
        assert not RAY_LOG_LINE.search(text), text[-4000:]


EXIT_IN_A_WEAKREF_CALLBACK = """
import sys, weakref
{install}
class Obj:
    pass

def callback(ref):  # what Ray's SIGTERM handler does when the signal lands in a weakref callback
    raise SystemExit(1)

obj = Obj()
ref = weakref.ref(obj, callback)
del obj
weakref.ref(Obj(), lambda r: 1 / 0)  # any other unraisable exception is still printed
print("went on")
"""


@pytest.mark.parametrize("installed", [False, True])
def test_a_sigterm_exit_in_a_callback_prints_no_traceback_in_a_trials_process(installed):
    """A trial's processes (the Tune trial, each Ray Train worker) call `quiet_exit_on_sigterm`:
    a SystemExit that Python cannot raise goes to Ray's log, not to the job log. Without it
    (the first case) Python prints `Exception ignored ... SystemExit: 1`."""
    install = (
        "from service.orchestration.launch import quiet_exit_on_sigterm; quiet_exit_on_sigterm()"
        if installed
        else ""
    )
    out = subprocess.run(
        [sys.executable, "-c", EXIT_IN_A_WEAKREF_CALLBACK.format(install=install)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout == "went on\n"
    assert "ZeroDivisionError" in out.stderr
    assert ("SystemExit" in out.stderr) is not installed, out.stderr
