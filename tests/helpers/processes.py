"""Processes the tests start: free loopback ports, and the processes of a `setsid` session."""

from __future__ import annotations

import os
import signal
import socket
import time


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
