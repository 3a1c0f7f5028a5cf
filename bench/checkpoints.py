"""checkpoint_ratio: the fast path's checkpoint save (atomic directory + retention) over a bare
torch.save of the same payload to the same filesystem; async_checkpoint_stall_ratio: how long
the training loop is blocked by an async save over a sync save of the same state;
async_stall_vs_copy: that stall over its floor, a plain copy of the same state's tensors into
buffers allocated beforehand (what any async save must do before training may go on)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from bench.common import figure
from service.trainer import checkpoint
from service.trainer.checkpoint import TrialState
from service.trainer.checkpoint_store import AsyncCheckpointer, CheckpointStore

REPEATS = 9


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
    tensors = list(_tensors(state.__dict__))
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
            t = time.perf_counter()
            saver.save(state, metrics)
            stall.append(time.perf_counter() - t)
            saver.wait()  # the eval interval is longer than a save: no save is still in flight
            async_store.wait_deletions()
            t = time.perf_counter()
            for buf, tensor in zip(buffers, tensors, strict=True):
                buf.copy_(tensor)
            copy.append(time.perf_counter() - t)
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
    }


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


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
            big["sync_save_s"] / big["torch_save_s"],
            state_bytes=big["bytes"],
            save_s=big["sync_save_s"],
            torch_save_s=big["torch_save_s"],
            small_state=small,
            filesystem=tempfile.gettempdir(),
            repeats=REPEATS,
        ),
        "async_checkpoint_stall_ratio": figure(
            "async_checkpoint_stall_ratio",
            big["async_stall_s"] / big["sync_save_s"],
            stall_s=big["async_stall_s"],
            sync_save_s=big["sync_save_s"],
            state_bytes=big["bytes"],
            small_state_ratio=small["async_stall_s"] / small["sync_save_s"],
        ),
        "async_stall_vs_copy": figure(
            "async_stall_vs_copy",
            big["async_stall_s"] / big["copy_s"],
            stall_s=big["async_stall_s"],
            copy_s=big["copy_s"],
            state_bytes=big["bytes"],
            small_state_ratio=small["async_stall_s"] / small["copy_s"],
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
