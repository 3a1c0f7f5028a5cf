"""Where the service's GPU step spends what a bare loop does not: the lm (bf16) and cnn (fp32,
input worker processes) steps of the service's loop, traced by the loop's own profiler
(`input.profile_steps`, with CUDA activity on a GPU), against the same number of steps of the
bare loops of bench.lm and bench.cnn under torch's profiler. Per step, for each side: kernels
launched, host-device copies, synchronisations, and the host operations that differ most in count
and time. Writes `profile.json` (and each trace, gzipped) to the folder given. Needs CUDA, no Ray.

    python -m bench.gpu_profile OUT_DIR
    python -m bench.gpu_profile --loop cnn-service   # one long block of one loop, for py-spy
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import run_trial

WARM_STEPS, PROFILED = 10, 20


def summary(trace_path: str, steps: int) -> dict:
    """Per-step counts from a Chrome trace: kernels, copies, runtime calls by name, and the host
    operations (name → count per step, milliseconds per step), largest first."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    by_cat = collections.Counter(e.get("cat") for e in events)
    runtime = collections.Counter(e["name"] for e in events if e.get("cat") == "cuda_runtime")
    ops_n, ops_ms = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_n[e["name"]] += 1
            ops_ms[e["name"]] += e.get("dur", 0) / 1000
    kernels_ms = sum(e.get("dur", 0) for e in events if e.get("cat") == "kernel") / 1000
    return {
        "kernels_per_step": by_cat["kernel"] / steps,
        "kernel_ms_per_step": kernels_ms / steps,
        "copies_per_step": (by_cat["gpu_memcpy"] + by_cat["gpu_memset"]) / steps,
        "runtime_per_step": {k: v / steps for k, v in runtime.most_common(12)},
        "ops_per_step": {
            k: [ops_n[k] / steps, round(ops_ms[k] / steps, 4)] for k, _ in ops_n.most_common(40)
        },
    }


def service_trace(study, hparams: dict, tmp: str, batch_source=None) -> str:
    run_trial(study, hparams, torch.device("cuda"), batch_source)
    (path,) = glob.glob(f"{study.storage}/**/profile/rank0.trace.json", recursive=True)
    shutil.move(path, f"{tmp}/service.json")
    return f"{tmp}/service.json"


def bare_trace(block, tmp: str) -> str:
    """`block()` runs PROFILED steps; it is run once untimed, then under the profiler."""
    block()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        block()
    prof.export_chrome_trace(f"{tmp}/bare.json")
    return f"{tmp}/bare.json"


def lm_case(tmp: str) -> tuple[str, str]:
    from bench import lm
    from service.data.text import write_text

    setup = lm.gpu_setup("bf16", PROFILED)
    write_text(f"{tmp}/data", lm.CORPUS_BYTES, setup.seq_len)
    traced = lm.gpu_setup("bf16", WARM_STEPS + PROFILED)
    warm = lm.study(f"{tmp}/data", f"{tmp}/warm", traced)
    run_trial(warm, setup.model_hparams, torch.device("cuda"))
    study = with_profile(lm.study(f"{tmp}/data", f"{tmp}/studies", traced))
    service = service_trace(study, setup.model_hparams, tmp)
    return service, bare_trace(lm.Bare(f"{tmp}/data", setup).rates, tmp)


def cnn_case(tmp: str) -> tuple[str, str]:
    from bench import cnn
    from service.data.images import write_images
    from service.data.process_input import process_source

    write_images(f"{tmp}/data", cnn.COUNT, seed=0)
    steps = WARM_STEPS + PROFILED
    cnn.service_row(f"{tmp}/data", f"{tmp}/warm", "cuda", "fp32", steps, cnn.GPU_INPUT_WORKERS)
    study = with_profile(
        cnn.single_trial_study(
            "bench-cnn",
            "images",
            f"{tmp}/data",
            f"{tmp}/studies",
            {"max_train_steps": steps, "batch_size": cnn.BATCH},
            cnn.HPARAMS["learning_rate"],
            {**cnn.INPUT, "num_input_workers": cnn.GPU_INPUT_WORKERS},
            True,
        )
    )
    service = service_trace(study, cnn.HPARAMS, tmp, process_source(cnn.GPU_INPUT_WORKERS))
    x, y = (t.cuda() for t in cnn.decoded(f"{tmp}/data"))
    return service, bare_trace(lambda: cnn.bare_images_per_s(x, y, "fp32", PROFILED), tmp)


def with_profile(study):
    from service.study import spec

    doc = spec.to_dict(study)
    doc["input"] = {**doc.get("input", {}), "profile_steps": PROFILED}
    return spec.load_dict(doc)


def one_loop(name: str) -> None:
    """A warm-up block then a long one of one loop (lm-service, lm-bare, cnn-service,
    cnn-bare), for a sampling profiler (py-spy) attached to this process."""
    from bench import cnn, lm
    from service.data.images import write_images
    from service.data.text import write_text

    with tempfile.TemporaryDirectory(prefix="playbook-loop-") as tmp:
        if name.startswith("lm"):
            setup = lm.gpu_setup("bf16", 0)
            write_text(f"{tmp}/data", lm.CORPUS_BYTES, setup.seq_len)
            for steps in (20, 400):
                s = lm.gpu_setup("bf16", steps)
                if name == "lm-bare":
                    lm.Bare(f"{tmp}/data", s).rates()
                else:
                    print(lm.service_rates(f"{tmp}/data", f"{tmp}/studies", s), flush=True)
            return
        write_images(f"{tmp}/data", cnn.COUNT, seed=0)
        x, y = (t.cuda() for t in cnn.decoded(f"{tmp}/data"))
        for steps in (100, 2000):
            if name == "cnn-bare":
                print(cnn.bare_images_per_s(x, y, "fp32", steps), flush=True)
            else:
                row = cnn.service_row(
                    f"{tmp}/data", f"{tmp}/studies", "cuda", "fp32", steps, cnn.GPU_INPUT_WORKERS
                )
                print(row["steps_per_s"] * cnn.BATCH, flush=True)


def main(out: str) -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_profile.py: no CUDA device here; nothing profiled", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": PROFILED}
    for name, case in (("lm_bf16", lm_case), ("cnn_fp32", cnn_case)):
        with tempfile.TemporaryDirectory(prefix=f"playbook-profile-{name}-") as tmp:
            traces = dict(zip(("service", "bare"), case(tmp), strict=True))
            results[name] = {side: summary(path, PROFILED) for side, path in traces.items()}
            for side, path in traces.items():
                with open(path, "rb") as f, gzip.open(f"{out}/{name}-{side}.json.gz", "wb") as g:
                    shutil.copyfileobj(f, g)
        print(
            name,
            json.dumps(
                {s: {k: v for k, v in r.items() if k != "ops_per_step"} for s, r in results[name].items()},
                indent=1,
            ),
            flush=True,
        )
    with open(f"{out}/profile.json", "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"]:
        one_loop(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench/gpu-profile"))
