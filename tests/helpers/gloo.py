"""Run a function on every rank of a CPU gloo process group (torch.multiprocessing, no Ray)."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join_gloo(rank: int, world_size: int, init_file: str) -> None:
    """This process as `rank` of a gloo group that meets through `init_file`."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


def _entry(rank, fn, world_size, init_file, out_dir, args):
    torch.set_num_threads(1)
    join_gloo(rank, world_size, init_file)
    try:
        result = fn(rank, world_size, *args)
        gc.collect()  # DDP's reducers go before their process group, not at interpreter exit
        dist.barrier()  # and no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_gloo(fn, world_size: int, tmp_path, *args) -> list:
    """Call `fn(rank, world_size, *args)` in `world_size` spawned processes joined in one gloo
    group; return each rank's result (tensors, lists, dicts and scalars), indexed by rank.
    `fn` must be a module-level function; a failure on any rank raises here."""
    out_dir = tmp_path / "gloo-results"
    out_dir.mkdir()
    init_file = tmp_path / "gloo-init"
    mp.spawn(_entry, args=(fn, world_size, str(init_file), str(out_dir), args), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
