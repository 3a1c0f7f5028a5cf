"""checkpoint_ratio: the fast path's checkpoint save (atomic directory + retention) over a bare
torch.save of the same payload to the same filesystem; async_checkpoint_stall_ratio: how long
the training loop is blocked by an async save over a sync save of the same state;
async_stall_vs_copy: that stall over its floor, a plain copy of the same state's tensors into
buffers allocated beforehand (what any async save must do before training may go on).

Each figure is the median over the repeats of the ratio of one repeat's two timings, taken back
to back (the machine is shared: a load change between repeats hits both sides of a ratio);
raw.ratio_spread has their interquartile range and each of them."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from bench.common import figure, tensors_of
from service.distributed import checkpoint
from service.distributed.checkpoint import TrialState
from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore

REPEATS = 15
STALL_PAIRS = 3
"""Async stalls and plain copies per repeat, interleaved (each is short and sees the load of its
moment: more pairs than saves)."""


def make_state(width: int, step: int = 1) -> TrialState:
    """A model and SGD-momentum optimizer state (about 2 * 2 * width^2 * 4 bytes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    history = [{"step": s, "validation/loss": 1.0 / s} for s in range(1, 11)]
    return TrialState(step, model.state_dict(), opt.state_dict(), [torch.get_rng_state()], history, {})


def measure(width: int, root: str) -> dict:
    state = make_state(width)
    store = CheckpointStore(os.path.join(root, f"store-{width}"), 2, "validation/loss", "min")
    async_store = CheckpointStore(os.path.join(root, f"async-{width}"), 2, "validation/loss", "min")
    saver = AsyncCheckpointer(async_store)
    bare_dir = os.path.join(root, f"bare-{width}")
    os.makedirs(bare_dir)
    tensors = list(tensors_of(state.__dict__))
    buffers = [torch.empty_like(t) for t in tensors]
    bare, sync, stall, copy = [], [], [], []
    try:
        for i in range(REPEATS):
            state.step = i + 1
            metrics = {"step": state.step, "validation/loss": 1.0 / (i + 1)}
            payload = {"format": checkpoint.FORMAT_VERSION, **state.__dict__}
            for first in (i % 2, 1 - i % 2):  # alternate which one goes first
                t = time.perf_counter()
                if first:
                    torch.save(payload, os.path.join(bare_dir, f"state-{i}.pt"))
                    bare.append(time.perf_counter() - t)
                else:
                    store.save(state, metrics)
                    sync.append(time.perf_counter() - t)
            # Both sides free what they no longer keep outside the clock (the store on its
            # deleting thread, which would otherwise overlap the next timed write).
            store.wait_deletions()
            if i >= 2:  # keep as many bare files as the store keeps checkpoints
                os.remove(os.path.join(bare_dir, f"state-{i - 2}.pt"))
            for j in range(STALL_PAIRS):
                for first in ((i + j) % 2, 1 - (i + j) % 2):
                    if first:
                        stall.append(_stall(saver, async_store, state, metrics))
                    else:
                        copy.append(_copy(buffers, tensors))
    finally:
        saver.close()
        store.close()
    size = os.path.getsize(os.path.join(bare_dir, f"state-{REPEATS - 1}.pt"))
    med = statistics.median
    return {
        "bytes": size,
        "torch_save_s": med(bare),
        "sync_save_s": med(sync),
        "async_stall_s": med(stall),
        "copy_s": med(copy),
        "sync_vs_torch_save": paired(sync, bare),
        "stall_vs_sync": paired(per_repeat(stall), sync),
        "stall_vs_copy": paired(stall, copy),
        "copy_vs_sync": paired(per_repeat(copy), sync),
    }


def per_repeat(values: list[float]) -> list[float]:
    """The median of each repeat's `STALL_PAIRS` values."""
    return [statistics.median(values[i : i + STALL_PAIRS]) for i in range(0, len(values), STALL_PAIRS)]


def paired(num: list[float], den: list[float]) -> dict:
    """The ratio of each repeat's two timings (measured back to back, so a change of the
    machine's load between repeats hits both alike): their median, and the interquartile range
    of them (`spread`)."""
    ratios = [n / d for n, d in zip(num, den, strict=True)]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return {
        "median": statistics.median(ratios),
        "spread": [round(q[0], 4), round(q[2], 4)],
        "pair_ratios": [round(r, 4) for r in ratios],
    }


def _stall(saver: AsyncCheckpointer, store: CheckpointStore, state: TrialState, metrics: dict) -> float:
    """Seconds the loop is blocked by an async save (the save then finishes off the clock: the
    eval interval is longer than a save, so no save is still in flight at the next one)."""
    t = time.perf_counter()
    saver.save(state, metrics)
    stalled = time.perf_counter() - t
    saver.wait()
    store.wait_deletions()
    return stalled


def _copy(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    """Seconds of a plain copy of the state's tensors into buffers allocated beforehand."""
    t = time.perf_counter()
    for buf, tensor in zip(buffers, tensors, strict=True):
        buf.copy_(tensor)
    return time.perf_counter() - t


def run() -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(
        prefix="playbook-bench-ckpt-", dir=os.environ.get("BENCH_CKPT_DIR")
    ) as root:
        big = measure(2048, root)  # ~64 MB: model + momentum buffers
        small = measure(64, root)  # ~66 KB: fixed costs (rename, meta.json, retention) dominate
    return {
        "checkpoint_ratio": figure(
            "checkpoint_ratio",
            big["sync_vs_torch_save"]["median"],
            state_bytes=big["bytes"],
            save_s=big["sync_save_s"],
            torch_save_s=big["torch_save_s"],
            ratio_spread=big["sync_vs_torch_save"],
            small_state=small,
            filesystem=tempfile.gettempdir(),
            repeats=REPEATS,
        ),
        "async_checkpoint_stall_ratio": figure(
            "async_checkpoint_stall_ratio",
            big["stall_vs_sync"]["median"],
            stall_s=big["async_stall_s"],
            sync_save_s=big["sync_save_s"],
            ratio_spread=big["stall_vs_sync"],
            copy_vs_sync_save=big["copy_vs_sync"]["median"],
            state_bytes=big["bytes"],
            small_state_ratio=small["stall_vs_sync"]["median"],
            repeats=REPEATS,
        ),
        "async_stall_vs_copy": figure(
            "async_stall_vs_copy",
            big["stall_vs_copy"]["median"],
            stall_s=big["async_stall_s"],
            copy_s=big["copy_s"],
            ratio_spread=big["stall_vs_copy"],
            state_bytes=big["bytes"],
            small_state_ratio=small["stall_vs_copy"]["median"],
            repeats=REPEATS,
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
