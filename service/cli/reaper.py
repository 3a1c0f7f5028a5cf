"""The embedded Ray of a `playbook` command ends with the command, however it ends.

A command without RAY_ADDRESS starts a Ray of its own (`prepare.connect_ray`). Ray ends most of
its processes with their driver, but not all: SIGKILLed, the driver left the raylet's
DashboardAgent and RuntimeEnvAgent running, and the next run on the machine competed with them.
So before `ray.init` the driver marks its environment with a token of its own (the processes
`ray.init` starts inherit it: the GCS, the raylet, the dashboard) and starts this file as a
watcher in a session of its own. While the driver lives, the watcher notes every POLL_S each
marked process and all its descendants (the raylet's agents and workers, whose retitled
environment no longer shows the token), each by pid and start time; once the driver has exited,
by any signal or none, it ends those still running: SIGTERM, then SIGKILL for what is left
after GRACE_S. Only this driver's Ray is marked: another Ray on the machine, or another
command's, is never touched. The marker is taken off the driver's environment once Ray is up,
so nothing else the driver starts carries it.

Standard library only: the watcher is this file run as a script (`python reaper.py PID TOKEN`),
not an import of the service."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

MARKER = "PLAYBOOK_EMBEDDED_RAY"
GRACE_S = 5.0
POLL_S = 1.0
_watchers: list[subprocess.Popen] = []  # held for the driver's life: the watcher outlives it


@contextlib.contextmanager
def ending_with_this_process() -> Iterator[None]:
    """Around the `ray.init` that starts an embedded Ray: what it starts is marked, and a watcher
    ends it after this process exits."""
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    _watchers.append(
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(os.getpid()), token],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the driver's process group: a Ctrl-C there is not for it
        )
    )
    before = os.environ.get(MARKER)
    os.environ[MARKER] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = before


def marked(token: str) -> list[int]:
    """The live processes (but this one) whose environment, as they were started, carries
    `token`. A process that rewrites its title over its environment (Ray's `ray::...` workers
    and agents, setproctitle) no longer shows it: `tree` finds those as children."""
    entry = f"{MARKER}={token}".encode()
    found = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:  # gone, or not ours to read
            continue
    return found


def pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]


def stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of a live process; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def tree(roots: list[int]) -> dict[int, int]:
    """`roots` and all their descendants: pid -> start time (what makes a pid this process)."""
    stats = {pid: s for pid in pids() if (s := stat(pid)) is not None}
    found, todo = {}, [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = stats[pid][1]
            todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return found


def alive(known: dict[int, int]) -> list[int]:
    """The processes of `known` still running as themselves (a pid reused since is not one)."""
    return [pid for pid, start in known.items() if (s := stat(pid)) is not None and s[1] == start]


def watch(driver: int, token: str) -> dict[int, int]:
    """Every process of the driver's Ray seen while the driver lived, once it has exited."""
    known: dict[int, int] = {}
    exited = exit_waiter(driver)
    while True:
        known.update(tree(marked(token)))
        if exited(POLL_S):
            break
    known.update(tree(marked(token)))
    return known


def exit_waiter(pid: int) -> Callable[[float], bool]:
    """A function that waits up to its argument's seconds for `pid` to exit; whether it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda _: True
    except OSError:  # no pidfd on this kernel: poll

        def poll(timeout_s: float) -> bool:
            time.sleep(timeout_s)
            return not os.path.exists(f"/proc/{pid}")

        return poll
    return lambda timeout_s: bool(select.select([fd], [], [], timeout_s)[0])


def end(known: dict[int, int]) -> None:
    """SIGTERM to the processes of `known` still alive, SIGKILL to those left after GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        for pid in alive(known):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while alive(known) and time.monotonic() < deadline:
            time.sleep(0.2)


if __name__ == "__main__":
    end(watch(int(sys.argv[1]), sys.argv[2]))
