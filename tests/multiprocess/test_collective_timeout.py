"""A collective whose peer stops answering (its host dropped off the network: the process lives
on, its connection stays open, nothing comes back) fails after the study's
`scaling.collective_timeout_s`, on a process group set up exactly as Ray Train's workers set up
theirs from the trial's `TorchConfig`."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.multiprocessing as mp

from service.study.training import Scaling

TIMEOUT_S = 3.0
SLACK_S = 10.0  # process start-up and a shared 2-core machine: the bound is T + this


def _rank(rank: int, init_file: str, timeout_s: float, out: str) -> None:
    import torch.distributed as dist
    from ray.train.torch.config import _setup_torch_process_group  # what each Train worker runs

    torch.set_num_threads(1)
    _setup_torch_process_group("gloo", rank, 2, f"file://{init_file}", timeout_s)
    dist.all_reduce(torch.ones(1))  # both ranks connected and answering
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # vanishes without closing its connection
        return
    time.sleep(0.5)  # rank 1 has stopped
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        outcome = "returned"
    except RuntimeError as e:
        outcome = f"raised {type(e).__name__}: {str(e).splitlines()[0]}"
    with open(out, "w") as f:
        f.write(f"{time.monotonic() - start}\n{outcome}\n")


def test_a_collective_with_a_vanished_peer_fails_within_the_timeout(tmp_path):
    from service.orchestration.launch import torch_config

    assert torch_config(Scaling()).timeout_s == 300.0  # the documented default, not Ray's 1800
    timeout_s = torch_config(Scaling(collective_timeout_s=TIMEOUT_S)).timeout_s
    ctx = mp.get_context("spawn")
    out = tmp_path / "rank0.txt"
    args = (str(tmp_path / "init"), timeout_s, str(out))
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=60 + TIMEOUT_S + SLACK_S)  # start-up (imports) included
        assert procs[0].exitcode == 0, "rank 0 did not come back from the collective"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    elapsed, outcome = out.read_text().splitlines()
    assert outcome.startswith("raised"), outcome
    assert TIMEOUT_S * 0.9 <= float(elapsed) <= TIMEOUT_S + SLACK_S, (elapsed, outcome)
