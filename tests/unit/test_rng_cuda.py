"""On CUDA: a checkpoint keeps the generator of the rank's own device (its current one) and a
resume restores it there, however many GPUs the process sees (a pool's rank sees the trial's
GPUs on its node). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from service.trainer import rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_current_devices_generator_is_kept_and_restored():
    device = torch.cuda.device_count() - 1  # the last one seen: not device 0, where there are several
    torch.cuda.set_device(device)
    rng.seed_all(7)
    torch.rand(3, device="cuda")
    state = rng.capture()
    assert len(state["cuda"]) == 1 and torch.equal(state["cuda"][0], torch.cuda.get_rng_state(device))
    want = torch.rand(5, device="cuda")
    torch.rand(100, device="cuda")
    rng.restore(state)
    assert torch.equal(torch.rand(5, device="cuda"), want)
