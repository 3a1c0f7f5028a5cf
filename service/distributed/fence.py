"""Fencing a trial's stranded writers.

A host that drops off the network keeps its processes running. Ray declares the node dead and
restarts the trial elsewhere; when the host comes back, its old rank 0 could go on writing into
the trial's folder (metrics log, predictions, topology record, checkpoints) over the new
attempt's files. So every attempt at a trial (a Ray Train worker group, a fast-path trial
process) claims the trial when it starts: it records a fresh attempt number and token in
`<trial>/attempt.json`. Before each write into the trial folder, the writer reads that file
back; when another attempt has claimed the trial since, the write is refused with a
`StaleAttemptError` and nothing is written. A checkpoint is checked right before its commit
(the atomic rename, or its manifest on an object store), and before retention deletes.

The attempts a process holds are kept by trial folder (`hold`), so the writers need no extra
argument; a process that holds no attempt at a trial (tests, `playbook eval`) writes unfenced.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass

from service.core import storage
from service.core.errors import PlaybookError
from service.study.layout import TrialLayout


class StaleAttemptError(PlaybookError):
    """This process's attempt at a trial was superseded by a later one: it must not write."""


@dataclass(frozen=True)
class Attempt:
    """One attempt at a trial: its number (1, 2, ... in the order they claimed it), a token that
    no other attempt has, and where it ran."""

    trial_uri: str
    attempt: int
    token: str
    host: str
    pid: int

    @property
    def record_uri(self) -> str:
        return TrialLayout(self.trial_uri).attempt

    def check(self, what: str) -> None:
        """Raise StaleAttemptError unless this attempt is still the trial's current one."""
        current = read(self.trial_uri)
        if current is not None and current.token == self.token:
            return
        later = "no attempt"
        if current is not None:
            later = f"attempt {current.attempt} on {current.host} (pid {current.pid})"
        storage.audit(f"refused {storage.join(self.trial_uri, what)}")
        raise StaleAttemptError(
            f"{self.record_uri}: attempt {self.attempt} of trial {TrialLayout(self.trial_uri).name} "
            f"(this process, {self.host} pid {self.pid}) was superseded by {later}; "
            f"{what} not written"
        )


_HELD: dict[str, Attempt] = {}  # trial folder URI -> this process's attempt at it


def read(trial_uri: str) -> Attempt | None:
    """The trial's current attempt as recorded on storage, or None before the first."""
    uri = TrialLayout(trial_uri.rstrip("/")).attempt
    if not storage.exists(uri):
        return None
    return Attempt(**json.loads(storage.read_bytes(uri)))


def claim(trial_uri: str) -> Attempt:
    """Start a new attempt at the trial: record it as the current one and hold it in this
    process (every earlier attempt's writes are refused from now on)."""
    trial_uri = trial_uri.rstrip("/")
    previous = read(trial_uri)
    attempt = Attempt(
        trial_uri,
        previous.attempt + 1 if previous else 1,
        uuid.uuid4().hex,
        socket.gethostname(),
        os.getpid(),
    )
    storage.write_bytes_atomic(attempt.record_uri, json.dumps(asdict(attempt)).encode())
    hold(attempt)
    return attempt


def hold(attempt: Attempt) -> None:
    """This process's writes into the attempt's trial folder are checked against it."""
    _HELD[attempt.trial_uri] = attempt


def held(trial_uri: str) -> Attempt | None:
    """This process's attempt at the trial, None where it holds none (tests, `playbook eval`)."""
    return _HELD.get(trial_uri.rstrip("/"))


def check(uri: str) -> None:
    """Before writing `uri`: raise StaleAttemptError when it lies in a trial folder that this
    process holds an attempt at and a later attempt has claimed that trial since."""
    target = uri.rstrip("/")
    for folder, attempt in _HELD.items():
        if target.startswith(folder + "/"):
            attempt.check(target[len(folder) + 1 :])
