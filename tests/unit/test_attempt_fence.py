"""Two attempts at one trial: once the second has claimed the trial, every write of the first
(metrics log, checkpoints saved in the caller's thread and in the background, predictions,
topology record) is refused with one line and leaves every file in the trial folder as it was."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch

from service.core import storage
from service.distributed import fence, topology_record
from service.distributed.checkpoint import TrialState
from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore
from service.evaluation import predictions
from service.study.layout import TrialLayout
from service.trainer.metrics_log import MetricsLog

METRIC = "validation/error"


@pytest.fixture(autouse=True)
def no_held_attempts():
    yield
    fence._HELD.clear()  # attempts are held per process: none leaks into other tests


def files_of(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def state(step: int, value: float) -> TrialState:
    return TrialState(step=step, model={"w": torch.full((3,), value)}, history=[{"step": step}])


def prediction_rows(step: int) -> dict[str, np.ndarray]:
    return {"example_id": np.arange(4) + step, "label": np.zeros(4, np.int64), "weight": np.ones(4)}


def write_everything(trial: TrialLayout, log: MetricsLog, store: CheckpointStore, step: int) -> None:
    log.write([{"step": s, METRIC: 1.0 / s} for s in range(10, step + 1, 10)])
    store.save(state(step, float(step)), {METRIC: 1.0 / step})
    predictions.write(trial.predictions("validation", step), prediction_rows(step), "validation", step)
    topology_record.write(trial.topology, trial.name, 1, [{"host_rank": 0, "step": step}])
    store.close()  # retention's deletions have finished


def test_a_superseded_attempt_writes_nothing_into_the_trial(tmp_path, monkeypatch):
    audit = tmp_path / "audit"
    audit.mkdir()
    monkeypatch.setenv(storage.AUDIT_ENV, str(audit))
    trial = TrialLayout(str(tmp_path / "study" / "trials" / "explore-0"))
    first = fence.claim(trial.uri)
    first_log, first_store = MetricsLog(trial.metrics_log), CheckpointStore(trial.uri, 1, METRIC, "min")
    write_everything(trial, first_log, first_store, 10)

    second = fence.claim(trial.uri)  # the restarted trial (held by this process from here on)
    write_everything(trial, MetricsLog(trial.metrics_log), CheckpointStore(trial.uri, 1, METRIC, "min"), 20)
    assert (first.attempt, second.attempt) == (1, 2)
    assert json.loads(pathlib.Path(trial.attempt).read_text())["token"] == second.token
    before = files_of(pathlib.Path(trial.uri))
    assert {"checkpoint_00000020/manifest.json", "metrics.jsonl", "topology.json"} <= set(before)

    fence.hold(first)  # this process is now the stranded first attempt
    audited = (audit / f"{os.getpid()}.log").read_text().splitlines()
    stale_writes = {
        "metrics.jsonl": lambda: first_log.write([{"step": s, METRIC: 0.0} for s in (10, 20, 30)]),
        "checkpoint_00000020": lambda: first_store.save(state(20, -1.0), {METRIC: 0.0}),  # same step
        "checkpoint_00000030": lambda: first_store.save(state(30, -1.0), {METRIC: 0.0}),
        "predictions/validation-step00000020.parquet": lambda: predictions.write(
            trial.predictions("validation", 20), prediction_rows(99), "validation", 20
        ),
        "topology.json": lambda: topology_record.write(trial.topology, trial.name, 1, [{"host_rank": 0}]),
    }
    for what, write in stale_writes.items():
        with pytest.raises(fence.StaleAttemptError) as e:
            write()
        assert str(e.value) == (
            f"{trial.attempt}: attempt 1 of trial explore-0 (this process, {first.host} pid {first.pid}) "
            f"was superseded by attempt 2 on {second.host} (pid {second.pid}); {what} not written"
        )
    background = AsyncCheckpointer(first_store)
    background.save(state(40, -1.0), {METRIC: 0.0})  # the commit runs on the saver's thread
    with pytest.raises(fence.StaleAttemptError, match="checkpoint_00000040 not written$"):
        background.close()
    assert files_of(pathlib.Path(trial.uri)) == before
    # The storage audit lists each refusal and no write after them.
    refused = [f"refused {trial.uri}/{what}" for what in [*stale_writes, "checkpoint_00000040"]]
    assert (audit / f"{os.getpid()}.log").read_text().splitlines() == audited + refused


def test_the_current_attempt_and_a_process_holding_none_write_as_before(tmp_path):
    trial = TrialLayout(str(tmp_path / "trials" / "explore-1"))
    write_everything(trial, MetricsLog(trial.metrics_log), CheckpointStore(trial.uri, 1, METRIC, "min"), 10)
    assert fence.read(trial.uri) is None  # no attempt claimed: unfenced (tests, `playbook eval`)
    fence.claim(trial.uri)
    fence.claim(trial.uri)  # a process that claims again holds the latest attempt
    write_everything(trial, MetricsLog(trial.metrics_log), CheckpointStore(trial.uri, 1, METRIC, "min"), 20)
    rows = [json.loads(line) for line in pathlib.Path(trial.metrics_log).read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20]
    assert fence.read(trial.uri).attempt == 2
