"""Run a function on every rank of a CPU gloo process group (torch.multiprocessing, no Ray)."""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOADED = [
    "tests.helpers.gloo",
    "service.trainer.loop",
    "service.distributed.sharded",
    "service.evaluation.run",
]
"""Imported once by the fork server that starts the ranks: each rank is a fork of it, ready to
run in a fraction of the seconds a fresh interpreter takes to import torch and the service."""


def join_gloo(rank: int, world_size: int, init_file: str) -> None:
    """This process as `rank` of a gloo group that meets through `init_file`."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


def _entry(rank, fn, world_size, init_file, out_dir, environ, args):
    # A fork of the fork server has the server's environment and writes to its stdout and
    # stderr: each rank takes the caller's environment, and writes to a file that `run_gloo`
    # copies to the caller's output.
    os.environ.clear()
    os.environ.update(environ)
    with open(os.path.join(out_dir, f"rank{rank}.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
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
    """Call `fn(rank, world_size, *args)` in `world_size` processes joined in one gloo group;
    return each rank's result (tensors, lists, dicts and scalars), indexed by rank. What the
    ranks print is printed here, rank by rank, once they are done. `fn` must be a module-level
    function; a failure on any rank raises here."""
    out_dir = tmp_path / "gloo-results"
    out_dir.mkdir()
    init_file = tmp_path / "gloo-init"
    multiprocessing.set_forkserver_preload(PRELOADED)  # used when the server first starts
    try:
        mp.start_processes(
            _entry,
            args=(fn, world_size, str(init_file), str(out_dir), dict(os.environ), args),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
    finally:
        for r in range(world_size):
            if (out_dir / f"rank{r}.log").exists():
                sys.stdout.write((out_dir / f"rank{r}.log").read_text())
                sys.stdout.flush()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
