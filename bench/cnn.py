"""The image CNN workload's figures: `cnn_step_ratio`, images/s of the service's step loop
(trainer.loop.train, one process, no Ray) on PNG parquet data, decoded and augmented online by an
input worker process with prefetch, over a bare PyTorch loop of the same model, optimizer and
batch size over images already decoded into a tensor in memory (no decoding, no augmentation),
as a paired ratio (`common.paired_ratio`: short blocks of the two loops interleaved, one torch
thread in this process and in the input worker, the median of the pairs' ratios); and
`cnn_exposed_input_fraction`, the share of the service's step time spent waiting for input (the
loop's own `input/exposed_fraction`).

The service does more work per image than the bare loop: the input worker decodes and augments
every image on another core. Its CPU seconds per image are in the raw figures (decoding and
augmentation, `decode_augment_cpu_s_per_image`; the worker's whole job with reading, shuffling
and pickling, `worker_cpu_s_per_image`; against the bare step's `bare_cpu_s_per_image`), with
`cpu_bound_ratio`, the ratio to expect where no core is idle for the worker (a 2-CPU host that
other processes share): bare / (bare + the worker's job). Raw `cpu_ratio` is the same pairs
counted in CPU seconds: the service charged with its process's CPU over its timed steps and, per
image, the input worker's whole job measured here (`worker_cpu_s_per_image`: read, decode,
augment, shuffle, pickle); the bare loop with its own. It is what the service costs per image,
less moved by other processes' load than the wall clock.

    python -m bench.cnn
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import statistics
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from bench.common import figure, paired_ratio, run_trial, single_trial_study
from service import workloads
from service.data.files import list_files
from service.data.images import write_images
from service.data.loader import TrainStream, WindowReader
from service.data.process_input import process_source
from service.data.sharding import RowRange

COUNT, STEPS, BATCH, PAIRS, THREADS = 4000, 60, 64, 9, 1
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "stages": 3, "weight_decay": 0.0}
INPUT = {"workers": "processes", "num_input_workers": 1, "prefetch_batches": 4}
"""One input worker process (`process_source`, as the Ray edge passes it for `input.workers:
processes`): the step keeps one of the 2 cores."""
GPU_STEPS, GPU_INPUT_WORKERS = 600, 4
"""On the GPU (`gpu_ratios`) a step takes a fraction of the CPU's: four input workers decode (the
GPU machine has the cores; one worker leaves the step waiting for input there), and blocks are
longer so that a trial's start does not weigh on its rate."""


def service_row(
    data_dir: str, storage: str, device: str = "cpu", precision: str = "fp32", steps=STEPS, workers=1
) -> dict:
    """The loop's one eval row: its steps/s and its exposed input fraction (`workers` input
    worker processes)."""
    training = {"max_train_steps": steps, "batch_size": BATCH, "precision": precision}
    use_gpu = torch.device(device).type == "cuda"
    study = single_trial_study(
        "bench-cnn",
        "images",
        data_dir,
        storage,
        training,
        HPARAMS["learning_rate"],
        {**INPUT, "num_input_workers": workers},
        use_gpu,
    )
    source = process_source(workers)
    return run_trial(study, HPARAMS, torch.device(device), batch_source=source)


def decoded(data_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The training images decoded once, up front: [n, 3, 32, 32] uint8, and the labels."""
    table = pq.read_table(f"{data_dir}/train", columns=["png", "label"])
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in table.column("png").to_pylist()])
    return torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()), torch.from_numpy(
        table.column("label").to_numpy()
    )


def bare_images_per_s(x: torch.Tensor, y: torch.Tensor, precision: str = "fp32", steps=STEPS) -> float:
    """What one writes by hand: tensors in memory (on x's device), a permutation per epoch, the
    usual 5 lines (under autocast for bf16)."""
    device = x.device
    torch.manual_seed(0)
    model = workloads.get("images").build_model(HPARAMS).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=HPARAMS["learning_rate"], momentum=HPARAMS["momentum"])
    perm, pos = torch.randperm(len(y), device=device), 0
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        if pos + BATCH > len(y):
            perm, pos = torch.randperm(len(y), device=device), 0
        i = perm[pos : pos + BATCH]
        pos += BATCH
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    synchronize(device)
    return steps * BATCH / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_ratios(pairs: int = 5) -> dict:
    """For bench/gpu.py (needs CUDA, not Ray): the same ratio with both loops on the GPU, the
    bare loop's decoded images in GPU memory, fp32 and bf16 (autocast on both sides), after one
    untimed block of each."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="playbook-bench-cnn-gpu-") as tmp:
        write_images(f"{tmp}/data", COUNT, seed=0)
        x, y = (t.cuda() for t in decoded(f"{tmp}/data"))
        for precision in ("fp32", "bf16"):

            def service(p=precision) -> dict:
                row = service_row(f"{tmp}/data", f"{tmp}/studies", "cuda", p, GPU_STEPS, GPU_INPUT_WORKERS)
                return {"wall": row["steps_per_s"] * BATCH}

            def bare(p=precision) -> dict:
                return {"wall": bare_images_per_s(x, y, p, GPU_STEPS)}

            service(), bare()  # kernels' first launches, cuDNN autotuning
            paired = paired_ratio(service, bare, pairs)
            out[precision] = {
                "cnn_step_ratio": paired["wall"]["ratio"],
                "service_images_per_s": paired["wall"]["service"],
                "bare_images_per_s": paired["wall"]["baseline"],
                "spread": paired["wall"]["spread"],
                "pair_ratios": paired["wall"]["pair_ratios"],
            }
    workers = {**INPUT, "num_input_workers": GPU_INPUT_WORKERS}
    return {**out, "steps": GPU_STEPS, "batch_size": BATCH, "model": HPARAMS, **workers}


def cpu_per_image(data_dir: str, x: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> dict:
    """CPU seconds per image (this process, one thread), each the median of `repeats` passes (the
    worker decodes without pause; a first pass also pays for fresh pages): the workload's
    `to_batch` (PNG decoding) and `augment` over the training files; the input worker's whole
    job (`worker_cpu_s_per_image`); and a bare block's step. Their `cpu_bound_ratio` (see the
    module docstring)."""
    workload = workloads.get("images")
    table = pq.read_table(f"{data_dir}/train")
    ids = torch.from_numpy(table.column("example_id").to_numpy())
    decode, augment, worker = [], [], []
    for _ in range(repeats):
        start = time.process_time()
        batch = workload.to_batch(table)
        decode.append((time.process_time() - start) / table.num_rows)
        start = time.process_time()
        workload.augment({**batch, "example_id": ids}, HPARAMS, 0, 0)
        augment.append((time.process_time() - start) / table.num_rows)
        worker.append(worker_cpu_s_per_image(data_dir))
    start = time.process_time()
    bare_images_per_s(x, y)
    bare = (time.process_time() - start) / (STEPS * BATCH)
    both = statistics.median(decode) + statistics.median(augment)
    return {
        "decode_cpu_s_per_image": statistics.median(decode),
        "augment_cpu_s_per_image": statistics.median(augment),
        "decode_augment_cpu_s_per_image": both,
        "worker_cpu_s_per_image": statistics.median(worker),
        "bare_cpu_s_per_image": bare,
        "cpu_bound_ratio": bare / (bare + statistics.median(worker)),
    }


def worker_cpu_s_per_image(data_dir: str) -> float:
    """What an input worker process does for one epoch's windows, here (`process_input._load`:
    read, decode, augment and shuffle a window, pickle its arrays), per image."""
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(f"{data_dir}/train")]
    stream = TrainStream(workloads.get("images"), ranges, BATCH, 0, hparams=HPARAMS)
    reader = WindowReader(stream.workload)
    tasks = list(itertools.takewhile(lambda t: t.epoch == 0, stream.plan(0)))
    start = time.process_time()
    for task in tasks:
        pickle.dumps({k: v.numpy() for k, v in stream.load(task, reader).items()}, pickle.HIGHEST_PROTOCOL)
    reader.close()
    return (time.process_time() - start) / stream.num_examples


def service_rates(row: dict, worker_cpu_s_per_image: float) -> dict:
    """Images per wall second (the loop's own clock) and per CPU second of the service: this
    process's (`steps_per_cpu_s`: the step, the batches' arrival) and its input worker's, at
    `worker_cpu_s_per_image`."""
    return {
        "wall": row["steps_per_s"] * BATCH,
        "cpu": 1 / (1 / (row["steps_per_cpu_s"] * BATCH) + worker_cpu_s_per_image),
    }


def bare_rates(x: torch.Tensor, y: torch.Tensor) -> dict:
    start = time.process_time()
    wall = bare_images_per_s(x, y)
    return {"wall": wall, "cpu": STEPS * BATCH / (time.process_time() - start)}


def run() -> dict:
    torch.set_num_threads(THREADS)
    rows = []

    def service() -> dict:
        rows.append(service_row(f"{tmp}/data", f"{tmp}/studies"))
        return service_rates(rows[-1], cpu["worker_cpu_s_per_image"])

    with tempfile.TemporaryDirectory(prefix="playbook-bench-cnn-") as tmp:
        write_images(f"{tmp}/data", COUNT, seed=0)
        x, y = decoded(f"{tmp}/data")
        cpu = cpu_per_image(f"{tmp}/data", x, y)
        paired = paired_ratio(service, lambda: bare_rates(x, y), PAIRS)
    exposed = statistics.median(r["input/exposed_fraction"] for r in rows)
    raw = {"steps": STEPS, "batch_size": BATCH, "pairs": PAIRS, "threads": THREADS, "images": COUNT, **INPUT}
    return {
        "cnn_step_ratio": figure(
            "cnn_step_ratio",
            paired["wall"]["ratio"],
            service_images_per_s=paired["wall"]["service"],
            bare_images_per_s=paired["wall"]["baseline"],
            spread=paired["wall"]["spread"],
            pair_ratios=paired["wall"]["pair_ratios"],
            load_avg_1m=paired["load_avg_1m"],
            cpu_ratio=paired["cpu"]["ratio"],
            cpu_pair_ratios=paired["cpu"]["pair_ratios"],
            **cpu,
            **raw,
        ),
        "cnn_exposed_input_fraction": figure(
            "cnn_exposed_input_fraction",
            exposed,
            each=[round(r["input/exposed_fraction"], 4) for r in rows],
            preprocess_s=[r["input/preprocess_s"] for r in rows],
            augment_s=[r["input/augment_s"] for r in rows],
            **raw,
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
