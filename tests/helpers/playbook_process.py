"""`playbook run` as a user runs it, on an embedded Ray of its own: started in a session of its
own (so that every process of its Ray can be found, and ended, by the session id), its output
in files; the processes of that session by their titles (`ray::Coordinator`, ...)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from tests.helpers.processes import session_pids

SERVICE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_run(study_file, folder) -> subprocess.Popen:
    """`playbook run STUDY_FILE` in `folder`, without RAY_ADDRESS; stdout and stderr in
    `folder`/out.txt and err.txt (read them with `output`). It takes SIGINT as a command run
    from a terminal does, however the tests were started (see `sigint_not_ignored`)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(os.path.join(folder, "out.txt"), "w") as out, open(os.path.join(folder, "err.txt"), "w") as err:
        with sigint_not_ignored():
            return subprocess.Popen(
                [sys.executable, "-m", "service", "run", str(study_file)],
                cwd=folder,
                env={**env, "PYTHONPATH": SERVICE_ROOT},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )


@contextlib.contextmanager
def sigint_not_ignored():
    """A shell without job control starts a background command (`make test &` in a script)
    with SIGINT ignored, every process under it inherits that, and Python then leaves Ctrl-C
    ignored, as a background job should. Processes started in here do not inherit it: a
    handled signal is reset to its default by exec."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def output(folder) -> tuple[str, str]:
    """(stdout, stderr) of the run started in `folder`."""
    with open(os.path.join(folder, "out.txt")) as out, open(os.path.join(folder, "err.txt")) as err:
        return out.read(), err.read()


def titles(sid: int) -> dict[int, str]:
    """pid -> command line (a Ray worker's is its title) of every process of session `sid`."""
    found = {}
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return found


def wait_for_title(proc: subprocess.Popen, title: str, timeout_s: float = 240) -> int:
    """The pid of the first process of `proc`'s session whose title starts with `title`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        pids = [pid for pid, cmd in titles(proc.pid).items() if cmd.startswith(title)]
        if pids:
            return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"no {title} process of the run came up (exit code {proc.poll()})")


def watchers_of(driver_pid: int) -> list[int]:
    """The `service/cli/reaper.py` watchers of the driver `driver_pid` still running."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"reaper.py") for a in args) and str(driver_pid).encode() in args:
            found.append(int(entry))
    return found
