"""Every random number generator a rank's training can draw from, seeded from the rank's data
seed, captured into each checkpoint and restored on resume: torch's CPU generator, the
generator of the rank's own CUDA device (its current one; a rank may see other ranks' GPUs, and
a resumed rank may see another number of them), numpy's global generator and Python's `random`
(a workload's augmentation may use any of them). Stored as tensors, ints and lists only, so that
`torch.load(weights_only=True)` reads them back."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def capture() -> dict:
    """This process's generator states."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }


def restore(state) -> None:
    """Set this process's generators to a `capture()`d state. A bare tensor is the torch CPU
    state alone (what checkpoints held before the other generators were kept)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(_own_device_state(state["cuda"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def _own_device_state(states: list) -> torch.Tensor:
    """The current device's state: the one captured, or from a checkpoint that kept every
    visible device's (before the rank kept only its own), the one at the current index."""
    return states[0] if len(states) == 1 else states[torch.cuda.current_device()]
