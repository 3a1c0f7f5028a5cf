"""The playbook's reading of a batch-size probe (`analysis.batch_size`) on hand-made tables with
hand-worked answers, the probe's stop rule, and the sizes it probes."""

from __future__ import annotations

import pytest

from service.analysis import batch_size
from service.analysis.batch_size import AT_MAX, MEMORY, NO_GAIN, probe_sizes, read
from service.core.errors import SpecError
from service.orchestration.batch_probe_task import probe_sizes as run_probe
from service.study import spec
from service.trainer.batch_probe import SizeResult
from tests.helpers.studies import MINIMAL_STUDY

OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def table(**examples_per_s) -> list[SizeResult]:
    """{'s8': 100.0, 's16': None, ...}: None is a size that does not fit."""
    return [
        SizeResult(int(k[1:]), eps is not None, eps, error=None if eps is not None else OOM)
        for k, eps in examples_per_s.items()
    ]


def study(hosts=1, workers=1, batch=32, **training) -> spec.Study:
    raw = {
        **MINIMAL_STUDY,
        "scaling": {"num_hosts": hosts, "workers_per_host": workers},
        "training": {**MINIMAL_STUDY["training"], "batch_size": batch, **training},
    }
    return spec.load_dict(raw)


# 64 -> 128 gains 740/700 - 1 = 5.7% (< 10%): scaling stops at 64; 256 is never reached.
STOPS_AT_64 = table(s8=100.0, s16=195.0, s32=380.0, s64=700.0, s128=740.0, s256=1500.0)


def test_scaling_stops_at_64():
    r = read(STOPS_AT_64, study(hosts=2, workers=2, batch=128))
    assert (r.per_worker_batch, r.global_batch, r.stopped) == (64, 256, NO_GAIN)
    # (700 / 100) ** (1 / 3) = 1.913: the mean gain per doubling from 8 to 64
    assert "per-worker batch size 64: the largest that still speeds training" in r.message
    assert "x1.91 per doubling from 8" in r.message
    assert "128 trains x1.06 its examples/s, below the x1.10 a doubling must give" in r.message
    assert "= 64 per worker x 4 worker(s) (2 host(s) x 2 per host) = 256" in r.message
    assert "training.batch_size: 256 (the study has 128)" in r.message
    assert "changing it means retuning" in r.message
    assert "the learning rate and the regularisation above all" in r.message


def test_first_size_does_not_fit():
    r = read(table(s8=None), study())
    assert (r.per_worker_batch, r.global_batch, r.stopped) == (None, None, MEMORY)
    assert r.message.startswith("no probed size fits: a per-worker batch of 8 does not fit in memory")
    assert OOM in r.message


def test_all_fit_and_keep_scaling_up_to_the_max():
    r = read(table(s8=100.0, s16=200.0, s32=400.0), study(batch=32))
    assert (r.per_worker_batch, r.global_batch, r.stopped) == (32, 32, AT_MAX)
    assert "still gaining at the largest size probed: rerun with a larger --max" in r.message
    assert "training.batch_size: 32 (the study's already)" in r.message


def test_out_of_memory_after_32():
    r = read(table(s8=100.0, s16=190.0, s32=350.0, s64=None), study(workers=2, batch=64))
    assert (r.per_worker_batch, r.global_batch, r.stopped) == (32, 64, MEMORY)
    assert f"64 does not fit in memory ({OOM})" in r.message


def test_the_gain_threshold_is_inclusive_and_can_be_set():
    rows = table(s8=4.0, s16=5.0, s32=6.0)  # +25% (exactly, in binary floating point), then +20%
    assert read(rows, study(), min_gain=0.25).per_worker_batch == 16
    assert read(rows, study()).per_worker_batch == 32
    assert read(rows, study(), min_gain=0.5).per_worker_batch == 8


@pytest.mark.parametrize(
    "rows,last", [(STOPS_AT_64, 128), (table(s8=100.0, s16=190.0, s32=None, s64=500.0), 32)]
)
def test_the_probe_stops_at_the_first_size_that_does_not_pay_or_fit(rows, last):
    """The loop measures no size past the first that gains too little or does not fit."""
    by_size, asked = {r.per_worker_batch: r for r in rows}, []
    got = run_probe(lambda s: asked.append(s) or by_size[s], sorted(by_size))
    assert asked == [s for s in sorted(by_size) if s <= last]
    assert got == rows[: len(asked)]


def test_table_marks_the_chosen_size_and_the_one_that_does_not_fit():
    rows = table(s8=100.0, s16=195.0, s32=None)
    s = study(batch=16)
    lines = batch_size.table_lines(rows, s, read(rows, s))
    assert lines[0].split("  ")[:4] == ["per-worker", "global", "examples/s", "x previous"]
    assert lines[2].split()[:4] == ["16", "16", "195", "x1.95"] and lines[2].endswith("chosen, study's")
    assert lines[3].split()[:4] == ["32", "32", "-", "-"] and lines[3].endswith("does not fit")


def test_probed_sizes_are_the_powers_of_two_between_min_and_max():
    assert probe_sizes(8, 128, study()) == [8, 16, 32, 64, 128]
    assert probe_sizes(1, 1, study()) == [1]
    # ghost batch norm: a single worker's batch holds whole virtual batches
    ghost = study(batch=64, ghost_batch_norm=True, virtual_batch_size=32)
    assert probe_sizes(8, 128, ghost) == [32, 64, 128]


@pytest.mark.parametrize(
    "low,high,message",
    [
        (8, 100, "--max: must be a power of two (got 100)"),
        (0, 64, "--min: must be a power of two (got 0)"),
        (64, 8, "--min: must be <= --max (64 > 8)"),
    ],
)
def test_bad_sizes_name_the_option(low, high, message):
    with pytest.raises(SpecError) as e:
        probe_sizes(low, high, study())
    assert str(e.value) == message


def test_ghost_batch_norm_without_a_power_of_two_virtual_batch_is_refused():
    ghost = study(batch=96, ghost_batch_norm=True, virtual_batch_size=48)
    with pytest.raises(SpecError, match=r"^training.virtual_batch_size: 48 divides no power of two"):
        probe_sizes(8, 1024, ghost)
