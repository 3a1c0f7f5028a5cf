"""GPU figures, for a machine with CUDA (never needed by CI; without CUDA it says so and exits 2
at once): the service's step loop on the GPU over a bare loop, bf16 autocast over fp32, the service's loop
with `training.precision` fp32 / bf16 / fp16, with 4 microbatches per step
(`training.microbatch_size`) and with `training.compile` (its steps/s include the compilation),
pinned over pageable host-to-device copies, an NCCL all-reduce, and the async checkpoint stall
with GPU state (pinned snapshot buffers), and the lm and cnn workloads' step ratios (bench.lm,
bench.cnn: the service's loop over a bare loop on the GPU, fp32 and bf16). Writes
bench/results-gpu.json. Needs no Ray.

    python -m bench.gpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_time(fn, repeats: int = 5) -> float:
    """Median seconds of `fn()` with the device synchronised around it."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bare_steps_per_s(width: int, batch: int, steps: int, autocast: bool) -> float:
    from service.workloads.digits import SmallConvNet

    torch.manual_seed(0)
    model = SmallConvNet(10, width).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.rand(batch * 8, 1, 8, 8, device="cuda")
    y = torch.randint(0, 10, (batch * 8,), device="cuda")

    def run():
        for s in range(steps):
            i = slice((s % 8) * batch, (s % 8 + 1) * batch)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    run()  # warm-up (kernels, cuDNN autotuning)
    return steps / cuda_time(run, 3)


def service_steps_per_s(steps: int, batch: int, width: int, **training) -> float:
    """steps/s of the service's loop on the GPU (one eval point, after the timed steps);
    `training`: extra study fields (precision, microbatch_size, compile)."""
    from bench.common import Discard
    from service.data.builtin import write_digits
    from service.distributed.topology import Topology
    from service.planning.trial import TrialPlan
    from service.study import spec
    from service.trainer import loop

    with tempfile.TemporaryDirectory() as tmp:
        write_digits(f"{tmp}/data")
        study = spec.load_dict(
            {
                "name": "gpu-step",
                "workload": "digits",
                "data": {"train": f"{tmp}/data/train", "validation": f"{tmp}/data/validation"},
                "storage": f"{tmp}/studies",
                "scaling": {"use_gpu": True},
                "training": {
                    "max_train_steps": steps,
                    "batch_size": batch,
                    "eval_every_steps": steps,
                    **training,
                },
                "search": {"learning_rate": {"role": "fixed", "value": 0.05}},
                "rounds": [{"name": "r", "num_trials": 1}],
            }
        )
        reporter = Discard()
        hp = {"learning_rate": 0.05, "momentum": 0.9, "width": width}
        loop.train(TrialPlan(study, "r-0", "r", hp, steps), Topology(), reporter, torch.device("cuda"))
        return reporter.rows[-1]["steps_per_s"]


def transfer_gb_per_s(pinned: bool, mb: int = 256) -> float:
    host = torch.empty(mb * 2**20 // 4, dtype=torch.float32, pin_memory=pinned)
    dev = torch.empty_like(host, device="cuda")
    return mb / 1024 / cuda_time(lambda: dev.copy_(host, non_blocking=pinned))


def nccl_all_reduce_gb_per_s(mb: int = 256) -> float:
    """One rank per visible GPU would need processes; with one GPU, a 1-rank NCCL group."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        t = torch.ones(mb * 2**20 // 4, device="cuda")
        dist.all_reduce(t)
        return mb / 1024 / cuda_time(lambda: dist.all_reduce(t))
    finally:
        dist.destroy_process_group()


def checkpoint_stall(width: int = 4096) -> dict:
    from service.distributed.checkpoint import TrialState
    from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore

    model = torch.nn.Linear(width, width).cuda()
    state = TrialState(1, model.state_dict(), {}, [], [], {})
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(f"{tmp}/sync", 2, "validation/loss", "min")
        saver = AsyncCheckpointer(CheckpointStore(f"{tmp}/async", 2, "validation/loss", "min"))
        sync, stall = [], []
        for step in range(1, 6):
            state.step = step
            m = {"step": step, "validation/loss": 1.0 / step}
            sync.append(cuda_time(lambda: store.save(state, m), 1))  # noqa: B023
            stall.append(cuda_time(lambda: saver.save(state, m), 1))  # noqa: B023
            saver.wait()
        saver.close()
        store.close()
    return {"sync_save_s": statistics.median(sync), "stall_s": statistics.median(stall)}


def lm_step_ratios() -> dict:
    """bench.lm's service loop over a bare loop on the GPU, for a model of realistic size (the
    CPU bench's tiny model is bound by kernel launches here), in fp32 and bf16."""
    from bench.lm import gpu_setup, measure

    out = {}
    for precision in ("fp32", "bf16"):
        raw = measure(gpu_setup(precision, steps=40), pairs=5)
        out[precision] = {"lm_step_ratio": raw.pop("ratio"), **raw}
    return out


def cnn_step_ratios() -> dict:
    """bench.cnn's service loop (PNG decoded and augmented online by an input worker process)
    over a bare loop on decoded tensors in GPU memory, in fp32 and bf16."""
    from bench.cnn import gpu_ratios

    return gpu_ratios()


def main() -> int:
    argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__).parse_args()  # --help
    if not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
        )
        return 2
    steps, batch, width = 300, 256, 32
    fp32 = bare_steps_per_s(width, batch, steps, autocast=False)
    bf16 = bare_steps_per_s(width, batch, steps, autocast=True)
    loop = {p: service_steps_per_s(steps, batch, width, precision=p) for p in ("fp32", "bf16", "fp16")}
    service = loop["fp32"]
    accumulation = service_steps_per_s(steps, batch, width, microbatch_size=batch // 4)
    compiled = service_steps_per_s(steps, batch, width, compile=True)
    stall = checkpoint_stall()
    lm = lm_step_ratios()
    cnn = cnn_step_ratios()
    results = {
        "device": torch.cuda.get_device_name(),
        "gpu_step_ratio": service / fp32,
        "service_steps_per_s": service,
        "bare_fp32_steps_per_s": fp32,
        "bf16_autocast_speedup": bf16 / fp32,
        "service_steps_per_s_by_precision": loop,
        "service_bf16_speedup": loop["bf16"] / loop["fp32"],
        "service_fp16_speedup": loop["fp16"] / loop["fp32"],
        "service_4_microbatches_steps_per_s": accumulation,
        "service_4_microbatches_over_whole": accumulation / service,
        "service_compile_steps_per_s_with_compilation": compiled,
        "pinned_over_pageable_h2d": transfer_gb_per_s(True) / transfer_gb_per_s(False),
        "nccl_all_reduce_gb_per_s_1_rank": nccl_all_reduce_gb_per_s(),
        "async_checkpoint_stall_ratio": stall["stall_s"] / stall["sync_save_s"],
        "checkpoint": stall,
        "lm_step_ratio_fp32": lm["fp32"]["lm_step_ratio"],
        "lm_step_ratio_bf16": lm["bf16"]["lm_step_ratio"],
        "lm": lm,
        "cnn_step_ratio_fp32": cnn["fp32"]["cnn_step_ratio"],
        "cnn_step_ratio_bf16": cnn["bf16"]["cnn_step_ratio"],
        "cnn": cnn,
    }
    with open(os.path.join(HERE, "results-gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
