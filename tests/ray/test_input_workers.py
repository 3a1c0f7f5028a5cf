"""Input worker processes (`input.workers: processes`): batches and a trial's metrics equal the
thread loader's bit for bit, also from a resumed middle step; a worker's error names the file."""

from __future__ import annotations

import itertools
import json
import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from service.analysis.input_bound import InputTotals, likely_cause
from service.core.errors import DataError
from service.data.files import list_files
from service.data.loader import TrainStream
from service.data.process_input import InputWorkerDied, process_source
from service.data.sharding import RowRange
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import TIMING_FIELDS, train
from service.workloads.digits import Digits
from tests.helpers.parquet_files import corrupt_column
from tests.helpers.trainer_runs import NoCheckpoints, read_log, train_in_process, without_timing


class BrokenDigits(Digits):
    """Digits whose online preprocessing fails on one example (a bug, not a data error)."""

    def to_batch(self, table):
        if 13 in table.column("example_id").to_pylist():
            raise RuntimeError("cannot augment example 13")
        return super().to_batch(table)


class KilledDigits(Digits):
    """Digits whose input worker process is SIGKILLed as it reaches example 13 (from outside,
    as by the kernel's OOM killer)."""

    def to_batch(self, table):
        if 13 in table.column("example_id").to_pylist():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().to_batch(table)


def write_files(directory, sizes: list[int], row_group_size: int, **options) -> list[RowRange]:
    start = 0
    for j, n in enumerate(sizes):
        ids = np.arange(start, start + n, dtype=np.int64)
        pixels = np.random.default_rng(j).random((n, 64)).astype(np.float32)
        table = pa.table(
            {
                "example_id": ids,
                "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 64),
                "label": ids % 10,
            }
        )
        pq.write_table(table, directory / f"part-{j}.parquet", row_group_size=row_group_size, **options)
        start += n
    return [RowRange(f, 0, f.num_rows) for f in list_files(str(directory))]


def test_worker_batches_are_the_thread_loaders_bit_for_bit_and_resume(tmp_path):
    # 3 files of 7-row groups (the last ones short), shuffled 3 groups at a time: 300 steps of
    # 9 rows cross epochs, windows and files many times over.
    ranges = write_files(tmp_path, [40, 23, 61], row_group_size=7)
    stream = TrainStream(Digits(), ranges, batch_size=9, data_seed=5, shuffle_window_row_groups=3)
    source = process_source(num_workers=2)
    for start in (0, 137):
        want = itertools.islice(stream.iterate(start), 300 - start)
        got = source(stream, start)
        for step, expected in enumerate(want, start):
            batch = next(got)
            assert batch.keys() == expected.keys()
            for key, value in expected.items():
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), (step, key)
        got.close()  # stops the workers


def test_a_worker_error_names_the_file(tmp_path):
    ranges = write_files(tmp_path, [20, 20], row_group_size=5)
    stream = TrainStream(BrokenDigits(), ranges, batch_size=4, data_seed=0, shuffle_window_row_groups=1)
    with pytest.raises(DataError, match=r"part-0\.parquet: an input worker failed on this window") as e:
        list(itertools.islice(process_source(num_workers=2)(stream, 0), 100))
    assert "RuntimeError: cannot augment example 13" in str(e.value)
    assert type(e.value.__cause__.__cause__).__name__ == "_RemoteTraceback"  # raised in a worker
    # A column that cannot be decoded is named with its file, as by the thread loader.
    ranges = write_files(tmp_path, [20, 20], row_group_size=5, compression="none")
    corrupt_column(tmp_path / "part-1.parquet", "pixels")
    stream = TrainStream(Digits(), ranges, batch_size=4, data_seed=0)
    with pytest.raises(DataError, match=r"part-1\.parquet: column 'pixels': cannot read row group"):
        list(itertools.islice(process_source(num_workers=2)(stream, 0), 100))


def test_a_killed_worker_is_a_lost_process_not_a_data_error(tmp_path):
    """A data error ends the trial at once (the same data fails the same way); a worker process
    that dies is retried from the trial's checkpoint, as any lost process (found by a chaos run:
    the trial ended FAILED)."""
    ranges = write_files(tmp_path, [20, 20], row_group_size=5)
    stream = TrainStream(KilledDigits(), ranges, batch_size=4, data_seed=0, shuffle_window_row_groups=1)
    with pytest.raises(InputWorkerDied, match="an input worker process died while it loaded a window") as e:
        list(itertools.islice(process_source(num_workers=2)(stream, 0), 100))
    assert not isinstance(e.value, DataError)


def test_with_worker_processes_the_input_bound_remedy_is_more_workers():
    waits = InputTotals(wait_s=5, step_s=10, read_s=0, preprocess_s=0)
    assert likely_cause(waits, False, 2, input_workers="processes")[0] == "input_workers"
    assert likely_cause(waits, False, 2)[0] == "prefetch_too_shallow"  # the same timings, locally


def test_a_trial_on_worker_processes_trains_as_on_the_thread_loader(digits_dir, tmp_path):
    """The loop with `input.workers: processes`: the same losses and metrics, step for step."""
    logs = {}
    for workers in ("local", "processes"):
        study = spec.load_dict(
            {
                "name": "workers",
                "workload": "digits",
                "data": {s: str(digits_dir / s) for s in ("train", "validation")},
                "storage": str(tmp_path / workers),
                "training": {"max_train_steps": 40, "batch_size": 32, "eval_every_steps": 20, "seed": 0},
                "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
                "rounds": [{"name": "r1", "num_trials": 1}],
                "input": {"workers": workers, "num_input_workers": 1},
            }
        )
        plan = TrialPlan(study, "r1-0", "r1", {"learning_rate": 0.1, "width": 4})
        source = process_source(study.input.num_input_workers) if workers == "processes" else None
        train(plan, Topology(), NoCheckpoints(), batch_source=source)
        with open(plan.metrics_uri) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        logs[workers] = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]
    assert [r["step"] for r in logs["local"]] == [20, 40]
    assert logs["processes"] == logs["local"]


@pytest.mark.ray
def test_worker_processes_inside_a_ray_trial(ray_cluster, digits_dir, tmp_path):
    """The same study on the Ray session cluster (the fast path trains inside a Tune trial, a
    Ray worker process whose main module is Ray's): worker processes start there too, and the
    trial logs what the in-process loop with the thread loader logs (the same trial config, on
    one thread as a fast-path trial of one CPU)."""
    from service.orchestration.study_run import run_study
    from service.planning.rounds import plan_round
    from tests.helpers.studies import study_dict

    def study_of(workers: str):
        raw = study_dict(
            digits_dir,
            tmp_path / workers,
            name=f"ray-{workers}",
            training={"max_train_steps": 40, "eval_every_steps": 20, "schedule": {"kind": "constant"}},
            search={
                "learning_rate": {"role": "fixed", "value": 0.1},
                "momentum": {"role": "fixed", "value": 0.9},
                "width": {"role": "fixed", "value": 4},
            },
            rounds=[{"name": "r1", "kind": "grid", "num_trials": 1}],
        )
        raw["input"] = {"workers": workers, "num_input_workers": 1}
        return spec.load_dict(raw)

    study = study_of("processes")
    rows = run_study(study)
    assert [r["status"] for r in rows] == ["FINISHED"], rows
    local = study_of("local")
    ((config,), (local_config,)) = (plan_round(s, s.rounds[0], []) for s in (study, local))
    local_plan = TrialPlan.from_config(local, local_config)
    train_in_process(local_plan)
    want = [without_timing(r) for r in read_log(local_plan)]
    assert [r["step"] for r in want] == [20, 40]
    assert [without_timing(r) for r in read_log(TrialPlan.from_config(study, config))] == want
