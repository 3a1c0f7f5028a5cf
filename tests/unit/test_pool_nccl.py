"""A pool's NCCL group is started as Ray Train starts a worker group's: a collective that times out
ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=1), unless the job's environment already
chooses; a gloo group sets nothing."""

from __future__ import annotations

from service.orchestration.worker_pool import error_handling_env
from service.study.training import Scaling

GPUS = Scaling(num_hosts=1, workers_per_host=2, use_gpu=True)


def test_an_nccl_group_ends_a_process_whose_collective_timed_out():
    assert error_handling_env(GPUS, {"PATH": "/bin"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_the_jobs_own_choice_is_kept():
    assert error_handling_env(GPUS, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) == {}
    assert error_handling_env(GPUS, {"TORCH_NCCL_BLOCKING_WAIT": "1"}) == {}


def test_a_gloo_group_sets_nothing():
    assert error_handling_env(Scaling(num_hosts=1, workers_per_host=2), {}) == {}
