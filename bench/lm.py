"""lm_step_ratio: tokens/s of the service's step loop (trainer.loop.train, one process, no Ray) on
the `lm` workload over a bare PyTorch loop of the same model, optimizer, batch, precision and
data (the corpus's training sequences as tensors in memory, a permutation per epoch).

Importable without Ray, for bench/gpu.py's CUDA runs: `measure(Setup(device="cuda", ...))`.

    python -m bench.lm
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

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


@dataclass(frozen=True)
class Setup:
    """One measurement's model, batch, length and precision (the same for both loops)."""

    steps: int = 60
    batch: int = 16
    seq_len: int = 128
    hparams: dict = field(default_factory=lambda: {"depth": 2, "width": 64, "heads": 4})
    precision: str = "fp32"
    device: str = "cpu"
    learning_rate: float = 1e-3

    @property
    def model_hparams(self) -> dict:
        return {**self.hparams, "context": self.seq_len, "learning_rate": self.learning_rate}


REPEATS, CORPUS_BYTES = 5, 600_000


def study(data_dir: str, storage: str, setup: Setup) -> spec.Study:
    training = {
        "max_train_steps": setup.steps,
        "batch_size": setup.batch,
        "eval_batch_size": setup.batch,
        "eval_every_steps": setup.steps,  # one eval + checkpoint, after the timed steps
        "metric": "validation/loss",
        "optimizer": "adamw",
        "schedule": {"kind": "constant"},
    }
    if setup.precision != "fp32":  # a study without the field is fp32, whatever the version
        training["precision"] = setup.precision
    return spec.load_dict(
        {
            "name": "bench-lm",
            "workload": "lm",
            "data": {"train": f"{data_dir}/train", "validation": f"{data_dir}/validation"},
            "storage": storage,
            "scaling": {"use_gpu": torch.device(setup.device).type == "cuda"},
            "training": training,
            "search": {"learning_rate": {"role": "fixed", "value": setup.learning_rate}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )


def service_steps_per_s(data_dir: str, storage: str, setup: Setup) -> float:
    s = study(data_dir, storage, setup)
    plan = TrialPlan(s, f"r-{time.monotonic_ns()}", "r", setup.model_hparams, setup.steps)
    reporter = Discard()
    loop.train(plan, Topology(), reporter, torch.device(setup.device))
    return reporter.rows[-1]["steps_per_s"]


def bare_steps_per_s(data_dir: str, setup: Setup) -> float:
    """What one writes by hand: the sequences in memory, the model, AdamW, the masked loss."""
    device, batch = torch.device(setup.device), setup.batch
    workload = workloads.get("lm")
    data = {k: v.to(device) for k, v in workload.to_batch(pq.read_table(f"{data_dir}/train")).items()}
    n = len(data["label"])
    positions = torch.arange(setup.seq_len, device=device)
    torch.manual_seed(0)
    model = workload.build_model(setup.model_hparams).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=setup.precision == "fp16")
    perm, pos = torch.randperm(n, device=device), 0
    synchronize(device)
    start = time.perf_counter()
    for _ in range(setup.steps):
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
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    synchronize(device)
    return setup.steps / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setup: Setup, repeats: int = REPEATS, corpus_bytes: int = CORPUS_BYTES) -> dict:
    """Medians over `repeats` alternating runs of each loop, in tokens (sequence positions) per
    second, after one untimed run of each on CUDA; the corpus is written once to a temporary
    folder."""
    with tempfile.TemporaryDirectory(prefix="playbook-bench-lm-") as tmp:
        data, storage, service, bare = f"{tmp}/data", f"{tmp}/studies", [], []
        write_text(data, corpus_bytes, setup.seq_len)
        if torch.device(setup.device).type == "cuda":  # kernels' first launches and autotuning
            service_steps_per_s(data, storage, setup), bare_steps_per_s(data, setup)
        for _ in range(repeats):
            service.append(service_steps_per_s(data, storage, setup))
            bare.append(bare_steps_per_s(data, setup))
    tokens = setup.batch * setup.seq_len
    return {
        "service_tokens_per_s": statistics.median(service) * tokens,
        "bare_tokens_per_s": statistics.median(bare) * tokens,
        "service_runs_steps_per_s": service,
        "bare_runs_steps_per_s": bare,
        **{k: v for k, v in asdict(setup).items() if k != "hparams"},
        "model": setup.hparams,
    }


def run() -> dict:
    torch.set_num_threads(1)
    raw = measure(Setup())
    ratio = raw["service_tokens_per_s"] / raw["bare_tokens_per_s"]
    return {"lm_step_ratio": figure("lm_step_ratio", ratio, threads=1, repeats=REPEATS, **raw)}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
