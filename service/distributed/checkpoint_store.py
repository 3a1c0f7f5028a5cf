"""A trial's checkpoints kept on storage without Ray Train (the single-worker fast path):
`<trial>/checkpoint_<step>` directories, the N best by the metric plus the latest, each one
either complete or not selectable; optionally saved in the background (`AsyncCheckpointer`).

Selectable = a `checkpoint_*` directory with its manifest (`distributed.checkpoint`: sizes and
CRC-32 of the other files, written last). On a local filesystem a checkpoint is written into a
hidden `.partial-*` directory and renamed into place, so a crash mid-write leaves nothing
selectable; on object stores state.pt and meta.json are uploaded before the manifest, and a
resume verifies the files against it. Deletion runs the other way round (manifest first, or a
rename away).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import posixpath
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from fsspec.implementations.local import LocalFileSystem

from service.core import storage
from service.core.errors import storage_full
from service.core.ranking import rank
from service.distributed import checkpoint, fence
from service.distributed.checkpoint import TrialState
from service.distributed.sharding import is_dtensor
from service.study.layout import CHECKPOINT_PREFIX, TrialLayout, checkpoint_name

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PARTIAL = ".partial-"


class CheckpointStore:
    """Checkpoints of one trial under `trial_uri`, keeping `keep` best by `metric` (ranked by
    `trial.rank`: on a tie the later step) + the latest. Rank 0 alone saves (`every_rank`)."""

    every_rank = False
    """Whether every rank of the trial calls `save` (a sharded checkpoint) or rank 0 alone."""

    def __init__(self, trial_uri: str, keep: int, metric: str, mode: str, clean: bool = True):
        """`clean`: remove what crashed saves left (the one process that saves, before it does)."""
        self.trial_uri, self.keep, self.metric, self.mode = trial_uri.rstrip("/"), keep, metric, mode
        self.fs, self.path = storage.split(self.trial_uri)
        self.local = isinstance(self.fs, LocalFileSystem)
        # Superseded checkpoints are unselectable at once (renamed away / meta.json removed);
        # freeing their bytes runs off the caller's path, on this thread.
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playbook-ckpt-rm")
        self._deletions: list[Future] = []
        self.fs.makedirs(self.path, exist_ok=True)
        for name in self._names() if clean else ():  # leftovers of a save that crashed: never selectable
            if name.startswith((PARTIAL, ".deleting-")):
                self.fs.rm(posixpath.join(self.path, name), recursive=True)

    def _names(self) -> list[str]:
        try:
            listed = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:  # an object store has no folder before its first object
            return []
        return [posixpath.basename(p.rstrip("/")) for p in listed]

    def uri(self, step: int) -> str:
        return TrialLayout(self.trial_uri).checkpoint(step)

    def save(self, state: TrialState, metrics: dict) -> str:
        """Write `state` as the checkpoint of its step, then drop what retention no longer keeps.
        A stale attempt at the trial (`distributed.fence`) writes nothing, and commits nothing when a
        later attempt claimed the trial while it was writing."""
        uri = self.uri(state.step)
        fence.check(uri)
        try:
            with self.staging(state.step, uuid.uuid4().hex[:8]) as folder:
                checkpoint.save(state, folder, metrics)
                self.publish(state.step, folder)
        except OSError as e:  # a full disk ends the trial in one line naming the checkpoint
            full = storage_full(uri, e)
            if full is None:
                raise
            raise full from None
        self._retain()
        return uri

    @contextlib.contextmanager
    def staging(self, step: int, tag: str):
        """Where the checkpoint of `step` is written before `publish`: locally a hidden folder
        beside it (named by `tag`: every rank of a sharded save writes into the same one),
        renamed into place; on an object store a temporary local folder, uploaded."""
        if self.local:
            folder = posixpath.join(self.path, f"{PARTIAL}{checkpoint_name(step)}-{tag}")
            try:
                yield folder
            except BaseException:  # what a failed save wrote goes at once (a full disk)
                shutil.rmtree(folder, ignore_errors=True)
                raise
            return
        with tempfile.TemporaryDirectory(prefix="playbook-ckpt-") as tmp:
            yield tmp

    def publish(self, step: int, folder: str) -> None:
        """Put the checkpoint committed in `folder` in place as the one of `step`, unless a later
        attempt claimed the trial meanwhile (a stale attempt commits nothing). Locally the
        `staging` folder is renamed into place, whole at once; on an object store its files are
        uploaded, the manifest last: until it is there, the checkpoint is not selectable."""
        name, uri = checkpoint_name(step), self.uri(step)
        final = posixpath.join(self.path, name)
        fence.check(uri)
        if self.local:
            if os.path.exists(final):  # a re-save of the same step after a resume
                self._delete(name)
            os.rename(folder, final)
            return
        self.fs.makedirs(final, exist_ok=True)
        for part in (checkpoint.STATE_FILE, checkpoint.META_FILE):
            self.fs.put_file(os.path.join(folder, part), f"{final}/{part}")
        fence.check(uri)
        manifest = checkpoint.MANIFEST_FILE
        self.fs.put_file(os.path.join(folder, manifest), f"{final}/{manifest}")

    def complete(self) -> list[tuple[str, dict]]:
        """(URI, meta) of every selectable checkpoint, by step."""
        out = []
        for name in self._names():
            if not name.startswith(CHECKPOINT_PREFIX):
                continue
            folder = posixpath.join(self.path, name)
            if not self.fs.exists(posixpath.join(folder, checkpoint.MANIFEST_FILE)):
                continue  # not committed
            try:
                with self.fs.open(posixpath.join(folder, checkpoint.META_FILE), "rb") as f:
                    meta = json.loads(f.read())
            except (FileNotFoundError, ValueError):
                continue
            out.append((storage.join(self.trial_uri, name), meta))
        return sorted(out, key=lambda um: um[1]["step"])

    def latest_state(self) -> TrialState | None:
        """The latest complete checkpoint's state (where a restarted trial resumes), or None."""
        done = self.complete()
        if not done:
            return None
        uri = done[-1][0]
        return checkpoint.load_verified(uri, lambda name: storage.read_bytes(storage.join(uri, name)))

    def retained(self) -> list[tuple[str, dict]]:
        """Keep the `keep` best and the latest of the trial's committed checkpoints (as after
        every save), whoever wrote them; (URI, meta) of those kept, by step."""
        self._retain()
        self.close()
        return self.complete()

    def _retain(self) -> None:
        done = self.complete()

        def score(meta: dict) -> tuple[float, int]:
            return rank(meta.get("metrics", {}).get(self.metric), meta["step"], self.mode)

        kept = {m["step"] for _, m in sorted(done, key=lambda um: score(um[1]))[: self.keep]}
        if done:
            kept.add(done[-1][1]["step"])  # the latest, for resuming
        for uri, meta in done:
            if meta["step"] not in kept:
                self._delete(posixpath.basename(uri))

    def _delete(self, name: str) -> None:
        fence.check(storage.join(self.trial_uri, name))
        path = posixpath.join(self.path, name)
        if self.local:
            away = posixpath.join(self.path, f".deleting-{name}-{uuid.uuid4().hex[:8]}")
            os.rename(path, away)
            self._deletions.append(self._deleter.submit(shutil.rmtree, away))
        else:
            self.fs.rm_file(posixpath.join(path, checkpoint.MANIFEST_FILE))
            self._deletions.append(self._deleter.submit(self.fs.rm, path, recursive=True))

    def wait_deletions(self) -> None:
        """Wait until the superseded checkpoints dropped so far are deleted."""
        done, self._deletions = self._deletions, []
        for f in done:
            f.result()

    def close(self) -> None:
        """Wait until superseded checkpoints are deleted."""
        self.wait_deletions()


def snapshot(state: TrialState, buffers: dict | None = None) -> TrialState:
    """A CPU copy of `state` that later training steps cannot change. With `buffers` (kept by
    the caller between snapshots), tensors are copied into the same preallocated memory each
    time (no fresh allocation and page faults; pinned memory for GPU tensors), all in one
    foreach copy (a call per tensor costs more than the copy for a model of many small ones)."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, tensor), copied at the end

    def copy(v, key: tuple):
        if is_dtensor(v):  # a shard: its local part copied (a DTensor again off the loop's path)
            # The local tensor itself: `to_local()` returns a view of it through an autograd
            # Function, ~10 us a tensor, which a model of a few hundred tensors pays per checkpoint.
            return LocalShard(copy(v._local_tensor, key), v)
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if buffers is None:
                return v.to("cpu", copy=True)
            buf = buffers.get(key)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                buf = buffers[key] = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
            pending.append((buf, v))
            return buf
        if isinstance(v, dict):
            return {k: copy(x, (*key, k)) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(copy(x, (*key, i)) for i, x in enumerate(v))
        return v

    out = TrialState(
        state.step,
        copy(state.model, ("model",)),
        copy(state.optimizer, ("optimizer",)),
        copy(state.rng_states, ("rng",)),
        _deep_copy_plain(state.history),
        dict(state.hparams),
        dict(state.scaler),
        state.shards,
    )
    if pending:
        on_gpu = any(v.is_cuda for _, v in pending)
        torch._foreach_copy_([b for b, _ in pending], [v for _, v in pending], non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
    return out


@dataclass(frozen=True)
class LocalShard:
    """A snapshot of one rank's part of a DTensor: its local tensor copied, and the DTensor it
    was copied from (its mesh, placement and global shape). Made back into a DTensor by
    `as_dtensors` on the saving thread: wrapping a few hundred tensors costs milliseconds, which
    the training loop would otherwise wait for."""

    local: torch.Tensor
    like: DTensor

    def dtensor(self) -> DTensor:
        like = self.like
        return type(like).from_local(
            self.local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )


def as_dtensors(tree):
    """`tree` (a snapshot's state dicts) with every `LocalShard` a DTensor again."""
    if isinstance(tree, LocalShard):
        return tree.dtensor()
    if isinstance(tree, dict):
        return {k: as_dtensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(as_dtensors(v) for v in tree)
    return tree


def _deep_copy_plain(value):
    """A deep copy of plain data (the history: numbers, strings, lists of them). A pickle round
    trip makes the same fresh objects as copy.deepcopy, faster, and the copy is part of the
    loop's stall (docs/performance.md)."""
    return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


class AsyncCheckpointer:
    """Saves into a `CheckpointStore` on a background thread. The training loop stalls only
    for the snapshot (a memory copy) and, when the previous save is still running, for it:
    at most one save is in flight, so memory holds at most one extra copy of the state.
    A failed background save is raised by the next `save` or by `close`."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.every_rank = store.every_rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playbook-ckpt")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._buffers: dict = {}  # reused: the previous save has finished before the next copy

    def save(self, state: TrialState, metrics: dict) -> str:
        self.wait()
        copied = snapshot(state, self._buffers)
        with self._lock:
            self._pending = self._pool.submit(self.store.save, copied, dict(metrics))
        return self.store.uri(state.step)

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.store.close()


class SyncCheckpointer:
    """The same interface, saving in the caller's thread."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.every_rank = store.every_rank

    def save(self, state: TrialState, metrics: dict) -> str:
        return self.store.save(state, metrics)

    def close(self) -> None:
        self.store.close()
