"""The FSDP figures, on gloo ranks of this machine (torch.multiprocessing, no Ray):

- fsdp_step_ratio: tokens/s of the service's FSDP trial (trainer.loop.train on 2 ranks, the lm
  model sharded by `scaling.strategy: fsdp`) over a bare FSDP2 loop of the same model, AdamW,
  batch and data on the same 2 ranks (each rank's training sequences in memory, a permutation
  per epoch, per-block fully_shard of the blocks then the root). Blocks of the two interleaved
  (ABBA) on both ranks at once; each pair's ratio of wall-clock rates (the ranks are in lock
  step, so one rank's clock is the trial's), the median of them. The service's rate is the
  loop's own `steps_per_s` (its steps, not its evaluation or checkpoint).
- fsdp_async_stall_vs_copy: how long the loop is blocked by an async sharded save (this rank's
  state dicts of model and optimizer, then the snapshot: `AsyncCheckpointer` over a
  `ShardedCheckpointStore`) over a plain copy of the same local shards into buffers allocated
  beforehand; the worst rank's median over repeats. A larger lm model (tens of MB a rank).
- fsdp_memory_per_rank_ratio (2 workers) and fsdp_memory_per_rank_ratio_4_workers: a rank's
  bytes of parameters, gradients and optimizer state after one step of the service's FSDP trial
  (the local shards) over a DDP rank's (whole copies), the largest over the ranks.

    python -m bench.fsdp
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from bench.common import (
    CpuClock,
    block_rates,
    figure,
    on_gloo_ranks,
    pair_stats,
    paired_rates,
    paired_raw,
    tensors_of,
)
from service import workloads
from service.data.text import write_text

SEQ_LEN, BATCH, STEPS, PAIRS = 128, 16, 40, 15
STEP_MODEL = {"depth": 2, "width": 64, "heads": 4, "context": SEQ_LEN}
BIG_MODEL = {"depth": 4, "width": 512, "heads": 8, "context": SEQ_LEN}
LEARNING_RATE, CORPUS_BYTES, STALL_REPEATS = 1e-3, 600_000, 7


def study(data: str, storage: str, strategy: str, workers: int, steps: int = STEPS):
    from service.study import spec

    return spec.load_dict(
        {
            "name": "bench-fsdp",
            "workload": "lm",
            "data": {"train": f"{data}/train", "validation": f"{data}/validation"},
            "storage": storage,
            "scaling": {"workers_per_host": workers, "strategy": strategy},
            "training": {
                "max_train_steps": steps,
                "eval_every_steps": steps,  # one evaluation and checkpoint, after the timed steps
                "batch_size": BATCH,
                "eval_batch_size": BATCH,
                "metric": "validation/loss",
                "optimizer": "adamw",
                "schedule": {"kind": "constant"},
                "async_checkpoint": False,
            },
            "search": {"learning_rate": {"role": "fixed", "value": LEARNING_RATE}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )


def topology(rank: int, world: int):
    from service.distributed.topology import Topology

    return Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)


class Rows:
    """A Reporter that keeps the eval rows; the loop's own step timing is in them."""

    def __init__(self, store):
        self.store, self.rows = store, []

    def report(self, metrics, checkpoint_dir):
        self.rows.append(metrics)

    def restore(self):
        return None


class Trials:
    """Blocks of the service's FSDP trial on this rank, each a new trial (the same name on
    every rank)."""

    def __init__(self, rank: int, world: int, data: str, storage: str):
        self.rank, self.world, self.data, self.storage, self.count = rank, world, data, storage, 0

    def rates(self) -> dict:
        from service.distributed.checkpoint_store import SyncCheckpointer
        from service.distributed.sharded import ShardedCheckpointStore
        from service.planning.trial import TrialPlan
        from service.trainer import loop

        self.count += 1
        s = study(self.data, self.storage, "fsdp", self.world)
        plan = TrialPlan(s, f"r-{self.count}", "r", {**STEP_MODEL, "learning_rate": LEARNING_RATE}, STEPS)
        store = ShardedCheckpointStore(plan.trial_uri, 1, "validation/loss", "min", self.rank)
        reporter, clock = Rows(store), CpuClock(loop.local_batches(plan.study.input.prefetch_batches))
        topo = topology(self.rank, self.world)
        loop.train(plan, topo, reporter, batch_source=clock, checkpointer=SyncCheckpointer(store))
        return {"wall": reporter.rows[-1]["steps_per_s"], "cpu": clock.steps_per_cpu_s()}


class Bare:
    """What one writes by hand with FSDP2: this rank's training sequences in memory (its contiguous
    part of the split, as the service's loader gives each worker its rows), the model sharded
    block by block then at the root, AdamW, the masked loss."""

    def __init__(self, rank: int, world: int, data: str):
        import pyarrow.parquet as pq

        table = pq.read_table(f"{data}/train")
        rows = len(table)
        mine = table.slice(rank * rows // world, (rank + 1) * rows // world - rank * rows // world)
        self.data = workloads.get("lm").to_batch(mine)
        self.rank, self.world = rank, world

    def rates(self) -> dict:
        data, batch = self.data, BATCH // self.world
        n, positions = len(data["label"]), torch.arange(SEQ_LEN)
        torch.manual_seed(0)
        model = workloads.get("lm").build_model(STEP_MODEL)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, foreach=True)
        generator = torch.Generator().manual_seed(self.rank)
        perm, pos = torch.randperm(n, generator=generator), 0
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(STEPS):
            if pos + batch > n:
                perm, pos = torch.randperm(n, generator=generator), 0
            i = perm[pos : pos + batch]
            pos += batch
            tokens, real = data["tokens"][i], positions < data["label"][i][:, None]
            targets = tokens[:, 1:].masked_fill(~real, -100)
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dist.barrier()
        return block_rates(STEPS, wall, cpu)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def step_bytes(rank: int, world: int, data: str, storage: str, strategy: str) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes after one step of the trial."""
    from service.planning.trial import TrialPlan
    from service.trainer.profiling import StepProfiler
    from service.trainer.setup import Progress, set_up
    from service.trainer.step import train_step

    plan = TrialPlan(
        study(data, storage, strategy, world), "m", "r", {**STEP_MODEL, "learning_rate": LEARNING_RATE}
    )
    ctx = set_up(plan, topology(rank, world), torch.device("cpu"))
    train_step(ctx, Progress(0, []), ctx.stream.iterate(0), StepProfiler("", 0, 1))
    params = list(ctx.model.parameters())
    state = [
        local(v) for s in ctx.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim
    ]
    return {
        "params": sum(local(p).nbytes for p in params),
        "grads": sum(local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer": sum(t.nbytes for t in state),
    }


def async_stall(rank: int, world: int, storage: str) -> dict:
    """Medians over repeats of this rank's loop stall for an async sharded save, and of a copy
    of the same local shards into preallocated buffers (alternating which goes first)."""
    from service.distributed import sharding
    from service.distributed.checkpoint import TrialState
    from service.distributed.checkpoint_store import AsyncCheckpointer
    from service.distributed.sharded import ShardedCheckpointStore

    torch.manual_seed(0)
    model = workloads.get("lm").build_model(BIG_MODEL)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=True)
    model(torch.randint(0, 256, (2, SEQ_LEN))).float().mean().backward()
    opt.step()
    saver = AsyncCheckpointer(ShardedCheckpointStore(f"{storage}/stall", 1, "validation/loss", "min", rank))
    tensors = [local(t) for t in tensors_of(sharding.state_dicts(model, opt))]
    buffers = [torch.empty_like(t) for t in tensors]
    stalls, copies = [], []
    try:
        for i in range(STALL_REPEATS):
            for first in (i % 2, 1 - i % 2):
                dist.barrier()
                t = time.perf_counter()
                if first:
                    model_sd, optim_sd = sharding.state_dicts(model, opt)
                    saver.save(TrialState(i + 1, model_sd, optim_sd), {"step": i + 1, "validation/loss": 1.0})
                    stalls.append(time.perf_counter() - t)
                    saver.wait()
                else:
                    for buf, tensor in zip(buffers, tensors, strict=True):
                        buf.copy_(tensor)
                    copies.append(time.perf_counter() - t)
    finally:
        saver.close()
    return {
        "stall_s": statistics.median(stalls),
        "copy_s": statistics.median(copies),
        "bytes": sum(t.nbytes for t in tensors),
    }


def paired_steps(rank: int, world: int, data: str, storage: str) -> dict:
    trials, bare = Trials(rank, world, data, storage), Bare(rank, world, data)
    trials.rates(), bare.rates()  # untimed: first imports, first allocations
    return paired_rates(trials.rates, bare.rates, PAIRS)


def memory_ratio(root: str, data: str, world: int) -> dict:
    ddp = on_gloo_ranks(step_bytes, world, root, data, f"{root}/ddp-{world}", "ddp")[0]
    fsdp = on_gloo_ranks(step_bytes, world, root, data, f"{root}/fsdp-{world}", "fsdp")
    total = sum(ddp.values())
    per_rank = [sum(r.values()) / total for r in fsdp]
    return {
        "ratio": max(per_rank),
        "per_rank": [round(r, 4) for r in per_rank],
        "ddp_bytes": ddp,
        "ranks": fsdp,
    }


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="playbook-bench-fsdp-") as root:
        data = f"{root}/data"
        write_text(data, CORPUS_BYTES, SEQ_LEN)
        memory = {w: memory_ratio(root, data, w) for w in (2, 4)}
        steps = pair_stats(on_gloo_ranks(paired_steps, 2, root, data, f"{root}/steps")[0])
        stalls = on_gloo_ranks(async_stall, 2, root, f"{root}/stall")
    worst = max(stalls, key=lambda s: s["stall_s"] / s["copy_s"])
    return {
        "fsdp_step_ratio": figure(
            "fsdp_step_ratio",
            steps["cpu"]["ratio"],
            **paired_raw(steps, "cpu", "steps/CPU s of rank 0"),
            service_steps_per_cpu_s=steps["cpu"]["service"],
            bare_steps_per_cpu_s=steps["cpu"]["baseline"],
            wall_steps_per_s=[steps["wall"]["service"], steps["wall"]["baseline"]],
            model=STEP_MODEL,
            batch=BATCH,
            steps=STEPS,
        ),
        "fsdp_async_stall_vs_copy": figure(
            "fsdp_async_stall_vs_copy",
            worst["stall_s"] / worst["copy_s"],
            ranks=stalls,
            model=BIG_MODEL,
            repeats=STALL_REPEATS,
        ),
        "fsdp_memory_per_rank_ratio": figure(
            "fsdp_memory_per_rank_ratio", memory[2].pop("ratio"), **memory[2]
        ),
        "fsdp_memory_per_rank_ratio_4_workers": figure(
            "fsdp_memory_per_rank_ratio_4_workers", memory[4].pop("ratio"), **memory[4]
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
