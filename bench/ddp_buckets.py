"""ddp_bucket_per_param_cost: steps/s of a CPU gloo DDP training step with the gradient buckets
the service uses on CPU (`service.trainer.setup.wrap_ddp`, chosen for bitwise resume on 3 or
more ranks) over DDP's default buckets, on the `images` workload's ResNet and the digits model,
2 and 3 ranks. The figure is the lowest of those four ratios.

Every variant trains its own copy of the same model in the same processes (one process per
rank, torch.multiprocessing + gloo, no Ray): short blocks of steps, the variants' blocks
interleaved in an order that turns over every round, and each round's ratio of a variant's rate
to the default's (its blocks ran moments apart, under about the same load of this shared
machine); the median of those ratios. raw also has one bucket per parameter (`per_param`, one
all-reduce per parameter tensor per step) over the default, for the record."""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from bench.common import figure, on_gloo_ranks, quartiles
from service import workloads
from service.trainer.setup import wrap_ddp

WORLDS = (2, 3)
MODELS = {"images": (32, (3, 32, 32), torch.uint8, 3), "digits": (32, (1, 8, 8), torch.float32, 30)}
"""workload: (rows per rank and step, one example's shape, dtype, steps per block: a few tenths
of a second each)."""
ROUNDS, WARMUP_STEPS = 6, 2


def variants(model: nn.Module) -> dict[str, nn.Module]:
    """Each variant's DDP around its own copy of `model` (same weights)."""
    return {
        "default": nn.parallel.DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False),
        "per_param": nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), broadcast_buffers=False, bucket_cap_mb_list=[0]
        ),
        "service": wrap_ddp(copy.deepcopy(model), "cpu"),
    }


def batch(workload: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, shape, dtype, _ = MODELS[workload]
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (rows, *shape), generator=g).to(dtype)
    return (x if dtype == torch.uint8 else x / 255), torch.randint(0, 10, (rows,), generator=g)


def steps(ddp: nn.Module, opt: torch.optim.Optimizer, x, y, n: int) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def block_rate(ddp, opt, x, y, n: int) -> float:
    """Steps per second of a block of `n` steps, timed between barriers (every rank done)."""
    dist.barrier()
    t = time.perf_counter()
    steps(ddp, opt, x, y, n)
    dist.barrier()
    return n / (time.perf_counter() - t)


def measure_model(workload: str, rank: int) -> dict[str, list[float]]:
    """Each variant's block rates, round by round (rank 0's clock)."""
    torch.manual_seed(0)
    ddps = variants(workloads.get(workload).build_model({}))
    opts = {k: torch.optim.SGD(d.parameters(), lr=0.01, momentum=0.9) for k, d in ddps.items()}
    x, y = batch(workload, rank)
    for k, d in ddps.items():  # the first steps rebuild DDP's buckets
        steps(d, opts[k], x, y, WARMUP_STEPS)
    names, rates = list(ddps), {k: [] for k in ddps}
    for r in range(ROUNDS):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order[::-1] if r % 2 else order:
            rates[k].append(block_rate(ddps[k], opts[k], x, y, MODELS[workload][3]))
    return rates


def measure_models(rank: int, world: int) -> dict:
    return {w: measure_model(w, rank) for w in MODELS}


def measure_world(world: int, root: str) -> dict:
    return on_gloo_ranks(measure_models, world, root)[0]


def ratios(rates: dict[str, list[float]], variant: str) -> dict:
    pairs = [a / b for a, b in zip(rates[variant], rates["default"], strict=True)]
    return {
        "ratio": round(statistics.median(pairs), 4),
        "spread": quartiles(pairs),
        "pair_ratios": [round(p, 4) for p in pairs],
        "steps_per_s": round(statistics.median(rates[variant]), 2),
        "default_steps_per_s": round(statistics.median(rates["default"]), 2),
    }


def run() -> dict:
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="playbook-bench-ddp-") as root:
        rates = {w: measure_world(w, root) for w in WORLDS}
    load.append(os.getloadavg()[0])
    cases = {f"{m}_{w}_ranks": rates[w][m] for w in WORLDS for m in MODELS}
    service = {k: ratios(r, "service") for k, r in cases.items()}
    return {
        "ddp_bucket_per_param_cost": figure(
            "ddp_bucket_per_param_cost",
            min(c["ratio"] for c in service.values()),
            service=service,
            per_param={k: ratios(r, "per_param") for k, r in cases.items()},
            parameter_tensors={m: len(list(workloads.get(m).build_model({}).parameters())) for m in MODELS},
            rows_per_rank={m: MODELS[m][0] for m in MODELS},
            block_steps={m: MODELS[m][3] for m in MODELS},
            rounds=ROUNDS,
            load_avg_1m=[round(x, 2) for x in load],
        )
    }
