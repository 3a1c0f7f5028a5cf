#!/usr/bin/env bash
# What a session runs on a lent GPU machine (the `device` tool), in one call: the profile of the
# service's lm and cnn GPU steps against bare loops (bench.gpu_profile), whether two NCCL ranks can
# share the one GPU (what an FSDP trial on one device would need), the CUDA tests (tests/unit/*_cuda.py),
# then every figure of bench.gpu.
# Everything lands in $OUT (bench/gpu-out without it). Needs CUDA, not Ray.
#
#     bash bench/gpu_session.sh
set -u
out=${OUT:-bench/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout "${PROFILE_TIMEOUT:-240}" python3 -m bench.gpu_profile "$out" || echo "bench.gpu_profile: exit $?"
timeout 90 python3 - <<'PY' || echo "two NCCL ranks on one GPU: exit $?"
import os, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r):
    dist.init_process_group("nccl", rank=r, world_size=2, device_id=torch.device("cuda:0"))
    t = torch.full((2,), float(r), device="cuda:0")
    dist.all_gather_into_tensor(out := torch.empty(4, device="cuda:0"), t)
    print("rank", r, "gathered", out.tolist(), flush=True)
    dist.destroy_process_group()

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
mp.start_processes(rank, nprocs=2, start_method="fork")  # spawn cannot re-import a script read from stdin
PY
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/*_cuda.py || echo "CUDA tests: exit $?"
timeout "${GPU_TIMEOUT:-330}" python3 -m bench.gpu > "$out/gpu.log" 2>&1
echo "bench.gpu: exit $?"
tail -n 40 "$out/gpu.log"
cp bench/results-gpu.json "$out/"
