"""lm_step_ratio: tokens/s of the service's step loop (trainer.loop.train, one process, no Ray) on
the `lm` workload over a bare PyTorch loop of the same model, optimizer, batch, precision and
data (the corpus's training sequences as tensors in memory, a permutation per epoch), as a
paired ratio (`common.paired_ratio`: short blocks of the two loops interleaved in this process,
one torch thread, the median of the pairs' ratios, per CPU second as in bench.step).

Importable without Ray, for bench/gpu.py's CUDA runs: `measure(Setup(device="cuda", ...))`.

    python -m bench.lm
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from bench.common import Rates, block_rates, figure, paired_ratio, paired_raw, run_trial, single_trial_study
from service import workloads
from service.data.text import write_text


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


PAIRS, CORPUS_BYTES, THREADS = 11, 600_000, 1


def gpu_setup(precision: str, steps: int) -> Setup:
    """The GPU figures' lm (bench.gpu, bench.gpu_profile): a model of realistic size (the CPU
    bench's tiny one is bound by kernel launches there), about 10M parameters."""
    model = {"depth": 6, "width": 384, "heads": 6}
    return Setup(steps=steps, batch=64, seq_len=256, hparams=model, precision=precision, device="cuda")


def study(data_dir: str, storage: str, setup: Setup):
    training = {
        "max_train_steps": setup.steps,
        "batch_size": setup.batch,
        "eval_batch_size": setup.batch,
        "metric": "validation/loss",
        "optimizer": "adamw",
    }
    if setup.precision != "fp32":  # a study without the field is fp32, whatever the version
        training["precision"] = setup.precision
    use_gpu = torch.device(setup.device).type == "cuda"
    return single_trial_study(
        "bench-lm", "lm", data_dir, storage, training, setup.learning_rate, use_gpu=use_gpu
    )


def service_rates(data_dir: str, storage: str, setup: Setup) -> Rates:
    row = run_trial(study(data_dir, storage, setup), setup.model_hparams, torch.device(setup.device))
    return {"wall": row["steps_per_s"], "cpu": row["steps_per_cpu_s"]}


class Bare:
    """What one writes by hand: the sequences in memory (read once, on the device), the model,
    AdamW, the masked loss; each block builds its model and optimizer as a trial does."""

    def __init__(self, data_dir: str, setup: Setup):
        self.setup, self.device = setup, torch.device(setup.device)
        table = pq.read_table(f"{data_dir}/train")
        self.data = {k: v.to(self.device) for k, v in workloads.get("lm").to_batch(table).items()}

    def rates(self) -> Rates:
        setup, device, batch, data = self.setup, self.device, self.setup.batch, self.data
        n = len(data["label"])
        positions = torch.arange(setup.seq_len, device=device)
        torch.manual_seed(0)
        model = workloads.get("lm").build_model(setup.model_hparams).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.0)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision)
        scaler = torch.amp.GradScaler(device.type, enabled=setup.precision == "fp16")
        perm, pos = torch.randperm(n, device=device), 0
        synchronize(device)
        wall, cpu = time.perf_counter(), time.process_time()
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
        return block_rates(setup.steps, wall, cpu)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setup: Setup, pairs: int = PAIRS, corpus_bytes: int = CORPUS_BYTES) -> dict:
    """The paired ratio (`common.paired_ratio`) of the two loops' tokens (sequence positions)
    per second, after one untimed block of each on CUDA; the corpus is written once to a
    temporary folder. On the CPU `ratio` counts per CPU second of this process (as bench.step
    does, see its docstring; `wall_ratio` per wall second); on CUDA per wall second."""
    with tempfile.TemporaryDirectory(prefix="playbook-bench-lm-") as tmp:
        data, storage = f"{tmp}/data", f"{tmp}/studies"
        write_text(data, corpus_bytes, setup.seq_len)
        bare = Bare(data, setup)
        cuda = torch.device(setup.device).type == "cuda"
        if cuda:  # kernels' first launches and autotuning
            service_rates(data, storage, setup), bare.rates()
        paired = paired_ratio(lambda: service_rates(data, storage, setup), bare.rates, pairs)
    tokens = setup.batch * setup.seq_len
    clock = "wall" if cuda else "cpu"
    value, wall = paired[clock], paired["wall"]
    return {
        "ratio": value["ratio"],
        "service_tokens_per_s": value["service"] * tokens,
        "bare_tokens_per_s": value["baseline"] * tokens,
        "wall_tokens_per_s": [wall["service"] * tokens, wall["baseline"] * tokens],
        **paired_raw(paired, clock, "tokens/s" if cuda else "tokens/CPU s"),
        **{k: v for k, v in asdict(setup).items() if k != "hparams"},
        "model": setup.hparams,
    }


def run() -> dict:
    torch.set_num_threads(THREADS)
    raw = measure(Setup())
    return {"lm_step_ratio": figure("lm_step_ratio", raw.pop("ratio"), threads=THREADS, **raw)}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
