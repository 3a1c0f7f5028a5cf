"""On CUDA: the batch-size probe measures each size's peak device memory, a batch larger than
the GPU's memory raises torch's real out-of-memory error, which the probe reports as not
fitting, and the memory it held is given back (a smaller size fits again after it). Skipped
without a GPU (tests/unit/test_batch_probe.py makes a real allocation failure on CPU)."""

from __future__ import annotations

import pytest
import torch

from service.trainer.batch_probe import measure
from tests.helpers.studies import make_study

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BALLAST_MIB = 2048
"""Device memory each row of a training batch holds (`tests.helpers.ballast_workload`)."""


def test_a_batch_past_the_gpu_memory_does_not_fit_and_the_probe_recovers(digits_dir, tmp_path):
    search = {
        "learning_rate": {"role": "fixed", "value": 0.1},
        "ballast_mib": {"role": "fixed", "value": BALLAST_MIB},
    }
    study = make_study(
        digits_dir,
        tmp_path,
        workload="tests.helpers.ballast_workload:BallastDigits",
        search=search,
        scaling={"use_gpu": True},
    )
    total = torch.cuda.get_device_properties(0).total_memory
    too_big = next(1 << k for k in range(20) if (1 << k) * BALLAST_MIB * 2**20 > total)

    def probe(size):
        return measure(study, size, "cuda", steps=1, warmup=1, min_seconds=0)

    fitting = [probe(size) for size in (2, 4, 8)]
    for r in fitting:
        assert r.fits and r.device.startswith("cuda: ") and r.examples_per_s > 0
        assert r.per_worker_batch * BALLAST_MIB * 2**20 <= r.peak_memory_bytes < total

    failed = probe(too_big)
    assert not failed.fits and failed.examples_per_s is None
    assert failed.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert torch.cuda.memory_allocated() < 2**30  # the failed size's tensors are gone
    assert torch.cuda.memory_reserved() < 4 * BALLAST_MIB * 2**20  # and its cached blocks given back

    again = probe(4)
    assert again.fits and again.peak_memory_bytes == pytest.approx(fitting[1].peak_memory_bytes, rel=0.05)
