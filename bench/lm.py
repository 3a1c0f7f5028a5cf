"""lm_step_ratio: tokens/s of the service's step loop (trainer.loop.train, one process, no Ray) on
the `lm` workload over a bare PyTorch loop of the same model, optimizer, batch, precision and
data (the corpus's training sequences as tensors in memory, a permutation per epoch).

Importable without Ray: bench/gpu.py calls `measure(device=cuda)`.

    python -m bench.lm
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from bench.common import figure
from bench.step import Discard
from service import workloads
from service.data.text import write_text
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer import loop
from service.trainer.topology import Topology

SEQ_LEN, BATCH, STEPS, REPEATS, CORPUS_BYTES = 128, 16, 60, 5, 600_000
HPARAMS = {"learning_rate": 1e-3, "depth": 2, "width": 64, "heads": 4, "context": SEQ_LEN}


def study(data_dir: str, storage: str, steps: int, batch: int, precision: str, device) -> spec.Study:
    training = {
        "max_train_steps": steps,
        "batch_size": batch,
        "eval_batch_size": batch,
        "eval_every_steps": steps,  # one eval + checkpoint, after the timed steps
        "metric": "validation/loss",
        "optimizer": "adamw",
        "schedule": {"kind": "constant"},
    }
    if precision != "fp32":  # a study without the field is fp32, whatever the service's version
        training["precision"] = precision
    return spec.load_dict(
        {
            "name": "bench-lm",
            "workload": "lm",
            "data": {"train": f"{data_dir}/train", "validation": f"{data_dir}/validation"},
            "storage": storage,
            "scaling": {"use_gpu": torch.device(device).type == "cuda"},
            "training": training,
            "search": {"learning_rate": {"role": "fixed", "value": HPARAMS["learning_rate"]}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )


def service_steps_per_s(data_dir, storage, steps, batch, precision="fp32", device="cpu") -> float:
    s = study(data_dir, storage, steps, batch, precision, device)
    plan = TrialPlan(s, f"r-{time.monotonic_ns()}", "r", dict(HPARAMS), steps)
    reporter = Discard()
    loop.train(plan, Topology(), reporter, torch.device(device))
    return reporter.rows[-1]["steps_per_s"]


def bare_steps_per_s(data_dir, steps, batch, precision="fp32", device="cpu") -> float:
    """What one writes by hand: the sequences in memory, the model, AdamW, the masked loss."""
    device = torch.device(device)
    workload = workloads.get("lm")
    data = {k: v.to(device) for k, v in workload.to_batch(pq.read_table(f"{data_dir}/train")).items()}
    n = len(data["label"])
    positions = torch.arange(SEQ_LEN, device=device)
    torch.manual_seed(0)
    model = workload.build_model(HPARAMS).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=HPARAMS["learning_rate"], weight_decay=0.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    perm, pos = torch.randperm(n, device=device), 0
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        if pos + batch > n:
            perm, pos = torch.randperm(n, device=device), 0
        i = perm[pos : pos + batch]
        pos += batch
        tokens, real = data["tokens"][i], positions < data["label"][i][:, None]
        targets = tokens[:, 1:].masked_fill(~real, -100)  # cross_entropy's ignore_index
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    synchronize(device)
    return steps / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    steps=STEPS, batch=BATCH, repeats=REPEATS, precision="fp32", device="cpu", corpus_bytes=CORPUS_BYTES
) -> dict:
    """Medians over `repeats` alternating runs of each loop, in tokens (sequence positions) per
    second; the corpus is written once to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="playbook-bench-lm-") as tmp:
        write_text(f"{tmp}/data", corpus_bytes, SEQ_LEN)
        service, bare = [], []
        for _ in range(repeats):
            service.append(
                service_steps_per_s(f"{tmp}/data", f"{tmp}/studies", steps, batch, precision, device)
            )
            bare.append(bare_steps_per_s(f"{tmp}/data", steps, batch, precision, device))
    tokens = batch * SEQ_LEN
    return {
        "service_tokens_per_s": statistics.median(service) * tokens,
        "bare_tokens_per_s": statistics.median(bare) * tokens,
        "service_runs_steps_per_s": service,
        "bare_runs_steps_per_s": bare,
        "steps": steps,
        "batch_size": batch,
        "seq_len": SEQ_LEN,
        "precision": precision,
        "device": str(device),
        "model": {k: v for k, v in HPARAMS.items() if k != "learning_rate"},
    }


def run() -> dict:
    torch.set_num_threads(1)
    raw = measure()
    ratio = raw["service_tokens_per_s"] / raw["bare_tokens_per_s"]
    return {"lm_step_ratio": figure("lm_step_ratio", ratio, threads=1, repeats=REPEATS, **raw)}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
