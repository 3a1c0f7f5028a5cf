"""Sharded checkpoints: a trial whose model is sharded over its ranks (FSDP) checkpoints with
`torch.distributed.checkpoint` (DCP). The playbook's "only rank 0 checkpoints" becomes:

1. every rank writes its own shards of the model and optimizer, in parallel, into the
   checkpoint's `model/` folder (DCP's `__<rank>_<n>.distcp` files; rank 0 also DCP's
   `.metadata`), and the size and CRC-32 of what it wrote;
2. rank 0 alone then writes state.pt (step, every rank's RNG, history, hyperparameters: what is
   not sharded) and meta.json, and commits the checkpoint with the manifest of every rank's
   files (`distributed.checkpoint`): the ranks' entries reach it through a gather, which every
   rank enters only once its own files are durable (DCP syncs them), so a committed checkpoint
   never lacks a shard;
3. rank 0 alone prunes (`CheckpointStore`'s retention, the same best N + latest).

On a local filesystem the ranks write into one hidden `.partial-*` folder that rank 0 renames
into place; on an object store each rank writes locally and uploads its files, and the manifest,
uploaded last, commits. A superseded attempt writes nothing (`distributed.fence`: every rank
holds the attempt rank 0 claimed).

Loading verifies before anything is read into the model: every rank checks that each listed
file exists with its size, and reads a share of the files to check their CRC-32; the ranks
agree, so a missing, truncated or damaged shard stops every rank with the same one-line
`CheckpointError` naming the file. DCP then reads each rank's part of every tensor, whatever the
number of ranks that wrote it (resharding), into the live model and optimizer.
"""

from __future__ import annotations

import os
import posixpath
import uuid
import warnings

import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from service.core import storage
from service.core.errors import CheckpointError
from service.distributed import checkpoint, fence, sharding
from service.distributed.checkpoint import STATE_FILE, TrialState
from service.distributed.checkpoint_store import CheckpointStore, as_dtensors
from service.study.layout import checkpoint_name

SHARDS_DIR = "model"
"""The folder of a sharded checkpoint that holds the DCP files."""
DCP_METADATA = ".metadata"


class ShardedCheckpointStore(CheckpointStore):
    """A trial's sharded checkpoints under `trial_uri`: every rank makes one (at the same point)
    and calls `save` and `latest_state`. Their collectives run on a gloo group of their own, so
    that a save on a background thread (`AsyncCheckpointer`) never interleaves with the
    training's collectives, and CPU copies of GPU shards need no device."""

    every_rank = True

    def __init__(self, trial_uri: str, keep: int, metric: str, mode: str, rank: int):
        super().__init__(trial_uri, keep, metric, mode, clean=rank == 0)
        self.rank = rank
        self.group = dist.new_group(backend="gloo")

    def save(self, state: TrialState, metrics: dict) -> str:
        """Write every rank's shards of `state.model` / `state.optimizer` (this rank's part of
        `state_dicts`), then rank 0 commits and prunes. Returns the checkpoint's URI."""
        fence.check(self.uri(state.step))
        tag = _broadcast(uuid.uuid4().hex[:8] if self.rank == 0 else None, self.group)
        with self.staging(state.step, tag) as folder:
            entries = self._write_shards(state, folder)
            if not self.local:  # each rank uploads its own shards
                fence.check(self.uri(state.step))
                final = posixpath.join(self.path, checkpoint_name(state.step))
                for relative in entries:
                    self.fs.put_file(os.path.join(folder, relative), f"{final}/{relative}")
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, entries, group=self.group)  # every rank's files are durable
        if self.rank == 0:
            self._commit(state, metrics, tag, {k: v for e in everyone for k, v in e.items()})
            self._retain()
        return self.uri(state.step)

    def _write_shards(self, state: TrialState, folder: str) -> dict[str, dict]:
        """This rank's DCP files in `folder/model/`: {path relative to folder: size and CRC-32}."""
        import torch.distributed.checkpoint as dcp  # imported where it is used: see `sharding`

        shards = os.path.join(folder, SHARDS_DIR)
        os.makedirs(shards, exist_ok=True)
        dcp.save(
            as_dtensors({"model": state.model, "optimizer": state.optimizer}),  # from a snapshot too
            storage_writer=dcp.FileSystemWriter(shards),
            process_group=self.group,
        )
        mine = [n for n in os.listdir(shards) if n.startswith(f"__{self.rank}_")]
        if self.rank == 0:
            mine.append(DCP_METADATA)
        return {f"{SHARDS_DIR}/{n}": checkpoint.file_entry(os.path.join(shards, n)) for n in sorted(mine)}

    def _commit(self, state: TrialState, metrics: dict, tag: str, shards: dict) -> None:
        """Rank 0: state.pt (without model and optimizer) and meta.json, then the manifest of
        them and every rank's shards, which commits the checkpoint."""
        rest = TrialState(
            state.step, {}, {}, state.rng_states, state.history, state.hparams, state.scaler, SHARDS_DIR
        )
        with self.staging(state.step, tag) as folder:  # locally, the folder the shards are in
            checkpoint.save(rest, folder, metrics, beside=shards)
            self.publish(state.step, folder)

    def close(self) -> None:
        """Wait for deletions, then end the store's process group (a reused pool of workers
        trains trial after trial: a group left per trial would keep its connections)."""
        super().close()
        dist.destroy_process_group(self.group)

    def latest_state(self) -> TrialState | None:
        """The newest checkpoint that verifies on every rank (older ones are tried when the
        newest is torn), as rank 0 lists them; None before the first."""
        listed = _broadcast([u for u, _ in self.complete()] if self.rank == 0 else None, self.group)
        for uri in reversed(listed):
            try:
                return load_state(uri, self.rank, dist.get_world_size(self.group), self.group)
            except CheckpointError as e:
                if self.rank == 0:
                    print(f"warning: {e}; resuming from an older checkpoint", flush=True)
        return None


def _broadcast(value, group):
    """Rank 0's `value` on every rank of `group`."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def load_state(uri: str, rank: int = 0, world: int = 1, group=None) -> TrialState:
    """The state of the committed checkpoint at `uri` (whole or sharded) once every rank has
    verified its share of the files (`verify`); a sharded one's model and optimizer are then
    read with `load_shards`."""
    verify(uri, rank, world, group)
    return checkpoint.load_verified(uri, _reader_of(uri), only=[STATE_FILE])


def verify(uri: str, rank: int = 0, world: int = 1, group=None) -> None:
    """Every file of the checkpoint at `uri` is there with its size (checked on every rank) and
    its CRC-32 (each rank reads its share, in chunks); every rank of `group` raises the same
    one-line CheckpointError, naming the file, when any rank found one wrong."""
    error = None
    try:
        listed = checkpoint.manifest(uri, _reader_of(uri))
        checkpoint.check_sizes(uri, listed, lambda name: storage.size(storage.join(uri, name)))
        names = sorted(n for n in listed["files"] if n != STATE_FILE)  # state.pt: every rank reads it
        mine = names[rank::world] if world > 1 else [*names, STATE_FILE]
        checkpoint.check_streamed(uri, listed, lambda name: storage.open_read(storage.join(uri, name)), mine)
    except CheckpointError as e:
        error = str(e)
    errors = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _reader_of(uri: str):
    return lambda name: storage.read_bytes(storage.join(uri, name))


def load_shards(state: TrialState, model, optimizer=None) -> None:
    """Read a sharded checkpoint's model (and optimizer) into the live ones: this rank's shards
    of a sharded model, or the whole of a plain one in a single process (`playbook eval` on one
    worker, `playbook export`)."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = sharding.load_targets(model, optimizer)
    target = {"model": model_sd, **({"optimizer": optim_sd} if optimizer is not None else {})}
    single = not sharding.is_sharded(model)
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: on purpose here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=_dcp_reader(state.shards), no_dist=single)
    sharding.load_state_dicts(model, optimizer, target["model"], target.get("optimizer", {}))


def _dcp_reader(uri: str):
    """DCP's reader over the service's storage (any fsspec URI, gs:// included)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

    fs, path = storage.split(uri)
    if isinstance(fs, LocalFileSystem):
        return FileSystemReader(path)
    reader = FileSystemReader(path)
    reader.fs = FsspecFileSystem()
    reader.fs.fs = fs
    return reader
