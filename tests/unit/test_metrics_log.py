"""A trial's metrics.jsonl is written as it grows: the whole history at a process's first write
(which replaces what an interrupted run logged past its checkpoint), then appends -- a local
append, a compose on gs:// -- with a whole rewrite where an append fails. Checked against lines
encoded here with json.dumps, on a local disk and on gcp-storage-emulator."""

from __future__ import annotations

import json
import math
import os

from service.core import storage
from service.trainer.metrics_log import MetricsLog


def rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"step": 10 * (i + 1), "validation/error": 1 / (i + 2), "train/loss": math.nan}
        for i in range(start, n)
    ]


def expected(history: list[dict]) -> str:
    fix = lambda r: {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}  # noqa: E731
    return "".join(json.dumps(fix(r)) + "\n" for r in history)


def test_a_local_log_is_appended_in_place_and_holds_every_row(tmp_path):
    uri = str(tmp_path / "trial" / "metrics.jsonl")
    log, history, inodes = MetricsLog(uri), [], set()
    for row in rows(40):
        history.append(row)
        log.write(history)
        assert open(uri).read() == expected(history)
        inodes.add(os.stat(uri).st_ino)
    assert len(inodes) == 1  # appended to the same file; a whole rewrite renames a new one in


def test_a_resumed_process_replaces_the_rows_logged_past_its_checkpoint(tmp_path):
    uri = str(tmp_path / "metrics.jsonl")
    first = MetricsLog(uri)
    for n in range(1, 6):  # the interrupted run logged 5 evaluations
        first.write(rows(n))
    resumed = MetricsLog(uri)
    history = rows(3)  # its checkpoint holds 3
    resumed.write(history)
    assert open(uri).read() == expected(history)
    history.append({"step": 40, "validation/error": 0.5, "train/loss": 1.0})
    resumed.write(history)
    assert open(uri).read() == expected(history)


def test_a_failed_append_rewrites_the_whole_log(tmp_path):
    uri = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(uri)
    log.write(rows(3))
    os.remove(uri)  # the append target is gone: the append fails
    log.write(rows(4))
    assert open(uri).read() == expected(rows(4))


def test_a_gcs_log_past_the_compose_size_is_composed_not_rewritten(gcs_emulator, monkeypatch):
    monkeypatch.setattr(storage, "COMPOSE_MIN_BYTES", 600)  # a few rows, not 256 KB of them
    uri = f"{gcs_emulator}/metrics-log/trial/metrics.jsonl"
    fs, path = storage.split(uri)
    composed = []
    merge = type(fs).merge  # the real compose, counted
    monkeypatch.setattr(
        type(fs), "merge", lambda self, *a, **k: composed.append(a[0]) or merge(self, *a, **k)
    )
    log, history = MetricsLog(uri), []
    for row in rows(30):
        history.append(row)
        log.write(history)
        fs.invalidate_cache()
        assert fs.cat_file(path).decode() == expected(history)
    # whole writes while the log is under 600 bytes, then one compose per new row
    whole = next(n for n in range(1, 31) if len(expected(rows(n)).encode()) >= 600)
    assert composed == [path] * (30 - whole)
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]  # no part object left behind


def test_an_append_cut_short_is_left_out_and_any_other_bad_line_is_named(tmp_path):
    """A process killed (or a disk filled) during an append leaves a partial last line: the
    complete rows read back; a line that is not JSON before the last is an error naming the file
    and line, not a JSONDecodeError."""
    import pytest

    from service.trainer import metrics_log

    uri = str(tmp_path / "metrics.jsonl")
    whole = expected(rows(3))
    with open(uri, "w") as f:
        f.write(whole + whole.splitlines()[0][:17])  # the fourth row's append, cut short
    want = [json.loads(line) for line in whole.splitlines()]
    assert metrics_log.read(uri) == want
    lines = whole.splitlines()
    with open(uri, "w") as f:
        f.write("\n".join([lines[0], lines[1][:17], lines[2]]) + "\n")
    with pytest.raises(storage.StorageError, match=f"{uri}: line 2 is not JSON"):
        metrics_log.read(uri)
