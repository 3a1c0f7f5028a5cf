"""A trial's per-evaluation log, `<trial>/metrics.jsonl`: one JSON row per evaluation, written
by rank 0 after each evaluation (and after the checkpoint of that step, so the log never lags
the latest checkpoint).

Written as it grows, so that a trial of E evaluations writes O(E) bytes, not O(E^2): the
first write of a process (a fresh trial, or a resumed one, whose history comes from its
checkpoint and replaces whatever an interrupted run logged past it) writes the whole history
atomically; each later one appends the new rows (`storage.append_bytes`: a local append, or a
compose on GCS once the log is large). Where a store cannot append, or an append fails, the
whole log is rewritten as before.
"""

from __future__ import annotations

import json
import math

from service.core import storage
from service.distributed import fence


def finite_or_none(v):
    """Strict JSON has no NaN or Infinity: a non-finite number is logged as null."""
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite_or_none(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def encode(rows: list[dict]) -> bytes:
    return "".join(json.dumps(finite_or_none(r)) + "\n" for r in rows).encode()


class MetricsLog:
    def __init__(self, uri: str):
        self.uri = uri
        self.rows = 0  # rows of the history that this process wrote to the log
        self.size = 0  # the log's bytes, as this process wrote them

    def write(self, history: list[dict]) -> None:
        """The log holds `history` after this (rows already written are not written again)."""
        fence.check(self.uri)
        if 0 < self.rows <= len(history):
            new = encode(history[self.rows :])
            try:
                appended = storage.append_bytes(self.uri, new, self.size)
            except storage.StorageError:
                appended = False  # it may have half happened: rewrite the whole log
            if appended:
                self.rows, self.size = len(history), self.size + len(new)
                return
        whole = encode(history)
        storage.write_bytes_atomic(self.uri, whole)
        self.rows, self.size = len(history), len(whole)


def read(uri: str) -> list[dict]:
    """A trial's logged evaluations in step order (non-finite values are None); [] when the
    trial logged none. A last line that is not JSON is an append cut short (the process killed,
    the disk full) and is left out: the trial's next run rewrites the log from its checkpoint.
    Any other line that is not JSON is a StorageError naming the file."""
    if not storage.exists(uri):
        return []
    lines = [line for line in storage.read_bytes(uri).decode(errors="replace").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if number == len(lines):
                break
            raise storage.StorageError(f"{uri}: line {number} is not JSON ({e})") from None
    return rows
