"""Processes the tests start: free loopback ports, the processes of a `setsid` session, the
lines of a command's output that are its own (not forwarded by Ray from its processes), and what
importing modules imports in a fresh interpreter."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

RAY_FORWARDED = re.compile(r"^(\x1b\[\d+m)?\([\w.:-]+ pid=\d+")
"""Ray's prefix of a line it forwards from one of its processes: "(TuneRun pid=N) ..."."""


def own_lines(text: str) -> list[str]:
    """The non-blank lines of `text` that are not Ray's forwarded ones."""
    return [line for line in text.splitlines() if line.strip() and not RAY_FORWARDED.match(line)]


def imported_along(imports: list[str], watched: list[str]) -> list[str]:
    """Which of the `watched` modules a fresh interpreter has once it has imported `imports`."""
    code = f"import sys, {', '.join(imports)}; print('\\n'.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def session_pids(sid: int) -> list[int]:
    """Every process in session `sid` (what a `setsid`-started `ray start --head` spawned)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def end_session(proc) -> None:
    """Wait for the processes of the killed driver's session (its embedded Ray) to go; kill
    what is left of them, by pid (all of them were started by this test)."""
    deadline = time.time() + 60
    while session_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    kill_session(proc.pid)


def kill_session(sid: int) -> None:
    """SIGKILL every process in session `sid`."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class EnvironWatcher:
    """While open, reads every `interval_s` the environment of each live process whose command
    line contains `marker` (a Ray actor's process title, e.g. "TrainController") and that started
    after it opened: `seen` maps pid -> its environment, as the process was started. With
    `only_env`, only processes whose environment holds those pairs (those a command run with them
    started: another Ray on the machine starts such processes too)."""

    def __init__(self, marker: str, interval_s: float = 0.1, only_env: dict[str, str] | None = None):
        self.marker, self.interval_s, self.seen = marker.encode(), interval_s, {}
        self.only_env = only_env or {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> EnvironWatcher:
        # Processes alive before it opens (one an earlier test left dying) are not its to see.
        self._before = {int(e) for e in os.listdir("/proc") if e.isdigit()}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in self.seen and int(entry) not in self._before:
                    environ = _environ_if(int(entry), self.marker)
                    if environ is not None and self.only_env.items() <= environ.items():
                        self.seen[int(entry)] = environ


def _environ_if(pid: int, marker: bytes) -> dict[str, str] | None:
    """Process `pid`'s environment when its command line contains `marker`, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker not in f.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return dict(p.split("=", 1) for p in pairs if "=" in p)
