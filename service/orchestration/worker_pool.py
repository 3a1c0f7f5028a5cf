"""Multi-worker trials on reused workers (the default; `scaling.reuse_workers: false` turns it
off): a Tune run's trials share one pool of worker processes and their process group (gloo on
CPUs, NCCL on GPUs), instead of a Ray Train controller, placement group and worker group
started for every trial (docs/performance.md).

- Placement: the trial reserves one bundle per worker through Tune (`tune_fit.trial_resources`,
  the placement strategy of a Ray Train trial). World rank 0 is the Tune trial's own process,
  in the first bundle, which trains and reports like the single-worker fast path; the pool's
  actors, one in each other bundle, are world ranks 1.. . A node's workers get consecutive
  world ranks, rank 0's node first, so hosts and local ranks follow from the node ids exactly
  as on Ray Train (`topology.placement`). Ray Data input workers, where the study asks for
  them, are started by each rank outside the trial's placement group, as from a Ray Train
  worker.
- GPUs: every rank sees the trial's GPUs on its node and trains on its own
  (`distributed.devices`), as a Ray Train worker group's workers do, so that NCCL can use
  CUDA IPC and NVLink between them.
- Start: the trial's process starts the pool's actors before it imports the trainer
  (`tune_run.tune_trial`), and each actor imports the trainer as it starts: both sides import
  at once, rather than the actors only once rank 0 is done.
- Reuse: Tune hands a finished trial's process to the run's next trial (`reuse_actors`); the
  pool, kept in this module, serves it. Every trial builds its own model, optimizer, RNG and
  data stream from its own seeds on every rank (`trainer.loop`), so a trial computes the same
  on a reused pool as on a new one.
- Checkpoints: rank 0 keeps a DDP trial's; under `fsdp` every rank writes its shards
  (`distributed.sharded`). Every rank holds the attempt rank 0 claimed (`distributed.fence`).
- Failures: a rank that fails ends the trial on every rank (a failed actor's peers are killed,
  which breaks rank 0's collectives), the pool is closed, and the error goes to Tune, which
  restarts the trial in a new process with a new pool; it resumes from its latest complete
  checkpoint on storage, which every rank reads. The run's other trials keep their pools.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.distributed import devices, fence
from service.distributed.topology import Topology, rank_topology, world_order
from service.orchestration import worker_console
from service.orchestration.tune_run import worker_env
from service.planning.trial import TrialPlan

if TYPE_CHECKING:  # torch and the trainer are imported once the pool's actors are starting
    import torch

    from service.trainer import loop

WATCH_INTERVAL_S = 0.2
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_pool: WorkerPool | None = None
"""This trial process's pool, kept for the Tune run's next trial."""


def start_pool(scaling) -> None:
    """Start this process's pool for `scaling` unless it has one: its actors start (and import)
    while this process goes on."""
    global _pool
    if _pool is not None and _pool.serves(scaling):
        return
    if _pool is not None:
        _pool.close()
    _pool = WorkerPool(scaling)


def train_in_pool(plan: TrialPlan, batch_source: loop.BatchSource | None) -> list[tuple[str, dict]]:
    """Train (or resume) a multi-worker trial on this process's pool, started on first use;
    returns its kept checkpoints (URI, meta). A trial that fails closes the pool."""
    global _pool
    start_pool(plan.study.scaling)
    pool, _pool = _pool, None
    kept = pool.train(plan, batch_source)
    _pool = pool
    return kept


def import_trainer() -> None:
    """Import what a rank's first trial needs: torch, the trainer, and torch._dynamo, which torch
    imports as it builds a process's first optimizer (over a second on its own)."""
    import torch._dynamo  # noqa: F401

    from service.orchestration import fast_path, launch  # noqa: F401


def own_placement() -> tuple[str, list[str]]:
    """This process's node id and the ids of the GPUs Ray gave it."""
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def see_gpus(scaling, visible: str) -> torch.device:
    """Make this process see the GPUs `visible` (a CUDA_VISIBLE_DEVICES value that includes its
    own) and use its own; that device. CUDA reads the variable once, as it starts in the
    process: nothing before a pool's first trial touches CUDA (a process where it had would
    not find its GPU at the index set here, and fail)."""
    import torch

    from service.orchestration import fast_path

    os.environ[devices.VISIBLE_ENV] = visible
    device = fast_path.trial_device(scaling)  # what the pool's trials train on
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def backend(scaling) -> str:
    """The process group's backend, as on Ray Train: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if scaling.use_gpu else "gloo"


def join_group(scaling, address: str, rank: int, world_size: int) -> None:
    """This process as `rank` of the pool's process group, whose collectives fail after
    `scaling.collective_timeout_s` (as a Ray Train worker group's do, `launch.torch_config`);
    under NCCL, as there, a timed-out collective ends the process unless the job says otherwise."""
    import torch.distributed as dist

    os.environ.update(error_handling_env(scaling, os.environ))
    timeout = datetime.timedelta(seconds=scaling.collective_timeout_s)
    dist.init_process_group(
        backend(scaling), init_method=address, rank=rank, world_size=world_size, timeout=timeout
    )


def error_handling_env(scaling, environ) -> dict[str, str]:
    """What Ray Train sets before an NCCL group starts: a collective that times out ends the
    process (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING=1), unless `environ` chooses already."""
    if backend(scaling) != "nccl" or {NCCL_ERROR_HANDLING, "TORCH_NCCL_BLOCKING_WAIT"} & set(environ):
        return {}
    return {NCCL_ERROR_HANDLING: "1"}


@ray.remote
class PoolWorker:
    """One of world ranks 1.. of a pool: a process in the pool's process group that trains
    trial after trial."""

    def __init__(self):
        worker_console.log_known_warnings()
        worker_console.quiet_exit_on_sigterm()
        import_trainer()  # while rank 0 imports it too

    def placement(self) -> tuple[str, list[str]]:
        return own_placement()

    def see_gpus(self, scaling, visible: str) -> torch.device:
        return see_gpus(scaling, visible)

    def join(self, scaling, address: str, rank: int, world_size: int) -> None:
        join_group(scaling, address, rank, world_size)

    def train(self, plan: TrialPlan, topo: Topology, attempt: fence.Attempt) -> None:
        from service.orchestration import fast_path, launch

        # World ranks 1..: rank 0 reports to Tune (and keeps a DDP trial's checkpoints).
        device = fast_path.trial_device(plan.study.scaling)
        fast_path.train_rank(plan, topo, device, launch.batch_source(plan.study), None, attempt)


class WorkerPool:
    """World ranks 1.. as actors in this trial's placement group (rank 0 is this process),
    joined with this process in one process group."""

    def __init__(self, scaling):
        """Start the pool's actors; they join this process's group on its first trial."""
        worker_console.log_known_warnings()  # rank 0 builds DDP in this process
        self.scaling, self.group = scaling, get_current_placement_group()
        self.workers = [self._start(bundle) for bundle in range(1, scaling.world_size)]
        self.topologies = []  # by world rank, once joined (the workers then in world rank order)

    def _join_once(self) -> None:
        """Place the started actors in world rank order and join them into one process group."""
        if self.topologies:
            return
        import_trainer()  # while the actors start
        placements = self._place()
        if self.scaling.use_gpu:
            self._share_gpus(placements)
        self._join()

    def _place(self) -> list[tuple[str, list[str]]]:
        """Put the actors in world rank order and set every rank's topology; each rank's (node
        id, GPU ids), by world rank."""
        rank0 = own_placement()
        placed = ray.get([w.placement.remote() for w in self.workers])
        order = world_order(rank0[0], [node for node, _ in placed])
        self.workers = [self.workers[i] for i in order]
        placements = [rank0, *(placed[i] for i in order)]
        node_ids = [node for node, _ in placements]
        self.topologies = [rank_topology(node_ids, rank) for rank in range(len(node_ids))]
        return placements

    def _share_gpus(self, placements: list[tuple[str, list[str]]]) -> list[tuple[str, torch.device]]:
        """Every rank sees the trial's GPUs on its node (`distributed.devices`), before NCCL
        and CUDA start in it; what each sees and the device it trains on, by world rank."""
        visible = devices.shared_gpus(placements)
        peers = [w.see_gpus.remote(self.scaling, v) for w, v in zip(self.workers, visible[1:], strict=True)]
        used = [see_gpus(self.scaling, visible[0]), *ray.get(peers)]
        return list(zip(visible, used, strict=True))

    def _start(self, bundle: int):
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)
        return PoolWorker.options(
            num_cpus=self.scaling.cpus_per_worker,
            num_gpus=1 if self.scaling.use_gpu else 0,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": worker_env(self.scaling)},
        ).remote()

    def _join(self) -> None:
        address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        size = len(self.topologies)
        joined = [w.join.remote(self.scaling, address, rank, size) for rank, w in enumerate(self.workers, 1)]
        join_group(self.scaling, address, 0, size)
        ray.get(joined)

    def serves(self, scaling) -> bool:
        """Whether this pool has the layout of `scaling`, in this process's placement group."""
        return scaling == self.scaling and get_current_placement_group() == self.group

    def train(self, plan: TrialPlan, batch_source: loop.BatchSource | None) -> list[tuple[str, dict]]:
        """One trial on every rank: rank 0 here, the others on the pool's actors."""
        from service.orchestration import fast_path

        try:
            self._join_once()
        except Exception:
            self.close()
            raise
        attempt = fence.claim(plan.trial_uri)  # held by every rank: each writes a sharded checkpoint
        peers = zip(self.workers, self.topologies[1:], strict=True)
        futures = [w.train.remote(plan, topo, attempt) for w, topo in peers]
        done = threading.Event()
        threading.Thread(target=self._watch, args=(futures, done), daemon=True).start()
        try:
            kept = fast_path.train_in_trial(plan, batch_source, self.topologies[0], attempt)
            ray.get(futures)
        except Exception as e:
            self.close()
            cause = worker_error(futures)  # what failed first, rather than rank 0's broken collective
            if cause is None:
                raise
            raise cause from e
        finally:
            done.set()
        return kept

    def _watch(self, futures: list, done: threading.Event) -> None:
        """Kill the pool's actors as soon as one of them fails: rank 0, waiting for the failed
        rank in a collective, then fails at once instead of after `collective_timeout_s`."""
        pending = list(futures)
        while pending and not done.is_set():
            ready, pending = ray.wait(pending, timeout=WATCH_INTERVAL_S)
            if any(failed(f) for f in ready):
                self.kill_workers()
                return

    def kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w)

    def close(self) -> None:
        import torch.distributed as dist

        self.kill_workers()
        if dist.is_initialized():
            dist.destroy_process_group()


def failed(future) -> bool:
    try:
        ray.get(future)
    except Exception:
        return True
    return False


def worker_error(futures: list) -> Exception | None:
    """The error that a pool actor's trial raised (a DataError keeps its type through Ray);
    None if none raised one (an actor that died or was killed raised nothing)."""
    ready, _ = ray.wait(futures, num_returns=len(futures), timeout=5)
    for f in ready:
        try:
            ray.get(f)
        except RayActorError:
            continue
        except Exception as e:
            return e
    return None
