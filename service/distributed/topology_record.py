"""Trial metadata: where every rank ran, its seeds, the files it actually opened, and
fingerprints of its initial weights and data order. Gathered from all ranks and written by
rank 0 to `<trial>/topology.json`, so a multi-host run can be audited after the fact."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

from service.core import storage
from service.distributed import fence
from service.distributed.topology import Topology


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def ids_sha256(example_ids: torch.Tensor) -> str:
    return hashlib.sha256(example_ids.cpu().numpy().tobytes()).hexdigest()


def gather(record: dict) -> list[dict]:
    """Every rank's `record`, indexed by world rank (this rank's alone when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def rank_record(
    topo: Topology,
    init_seed: int,
    data_seed: int,
    init_params: str,
    train_files: list[str],
    first_batch_ids: torch.Tensor,
    resumed_from_step: int = 0,
) -> dict:
    return {
        "world_rank": topo.world_rank,
        "host_rank": topo.host_rank,
        "local_rank": topo.local_rank,
        "node_id": topo.node_id,
        "pid": os.getpid(),
        "init_seed": init_seed,
        "data_seed": data_seed,
        "init_params_sha256": init_params,
        "train_files": train_files,
        "first_batch_sha256": ids_sha256(first_batch_ids),
        "resumed_from_step": resumed_from_step,
    }


def write(uri: str, trial_name: str, requested_hosts: int, records: list[dict]) -> None:
    hosts = len({r["host_rank"] for r in records})
    if hosts != requested_hosts:
        print(
            f"[{trial_name}] warning: ran on {hosts} host(s), the study asked for "
            f"{requested_hosts}; data was sharded over the {hosts} actual host(s)",
            flush=True,
        )
    fence.check(uri)
    storage.write_json(
        uri,
        {"trial_name": trial_name, "requested_hosts": requested_hosts, "num_hosts": hosts, "ranks": records},
    )
