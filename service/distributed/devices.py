"""Which GPUs a trial's process sees, and which of them is its own.

Ray makes a process that holds a GPU see only that GPU (CUDA_VISIBLE_DEVICES). NCCL between
processes that cannot see each other's GPUs cannot use CUDA IPC or NVLink, only host memory,
and NCCL has known faults with such per-process masks on NVSwitch machines. So the processes
of one trial on one node see all of that trial's GPUs on the node, and each uses its own by its
place among them: what Ray Train does for a worker group (`share_cuda_visible_devices`), here
for a pool of reused workers (`orchestration.worker_pool`)."""

from __future__ import annotations

from collections import defaultdict

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def shared_gpus(placements: list[tuple[str, list[str]]]) -> list[str]:
    """For each rank's (node id, its GPU ids), the GPUs it is to see: every GPU of the ranks on
    its node, in id order, as CUDA_VISIBLE_DEVICES spells them ("0,1,3")."""
    on_node: dict[str, set[str]] = defaultdict(set)
    for node, gpus in placements:
        on_node[node].update(gpus)
    ordered = {node: sorted(ids, key=_id_order) for node, ids in on_node.items()}
    return [",".join(ordered[node]) for node, _ in placements]


def gpu_index(visible: str | None, own: list) -> int:
    """The CUDA device index of this process's GPU (`own`: Ray's id for it) among the GPUs it
    sees (`visible`, its CUDA_VISIBLE_DEVICES; None or empty where nothing masks them, so the
    index is the id)."""
    if len(own) != 1:
        raise RuntimeError(f"a training process holds one GPU; Ray gave this one {len(own)} ({own})")
    (gpu,) = (str(g) for g in own)
    if not visible:
        return int(gpu)
    seen = visible.split(",")
    if gpu not in seen:
        raise RuntimeError(f"{VISIBLE_ENV}={visible} does not include this process's GPU {gpu}")
    return seen.index(gpu)


def _id_order(gpu: str) -> tuple[int, int | str]:
    return (0, int(gpu)) if gpu.isdigit() else (1, gpu)  # "10" after "9"; a UUID after numbers
