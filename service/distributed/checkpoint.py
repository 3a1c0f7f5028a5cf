"""Trial state on disk: model, optimizer, step (= schedule and data position), RNG states of
every rank, and the metrics history. Loaded with `weights_only=True` (no pickled code).

A checkpoint is committed by its manifest, written last: the size and CRC-32 of every other
file. A directory without a manifest, or whose files do not match it (a crash between two
writes, or a copy to storage cut off half way, in whatever order the copy went), is not a
checkpoint: `load` refuses it and `latest_complete` skips it.

The digest guards against accidents (torn copies, mixed-up or damaged files), not tampering, so
it is CRC-32: it is computed while state.pt is written, in place of the per-record CRC-32s that
torch.save would put into its zip (torch.load never checks those), so a save costs about what a
bare torch.save does. Manifests of format 1 (sha256) are still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
from torch.utils.serialization import config as serialization_config

from service.core.errors import CheckpointError

STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
"""Format of the state.pt payload of a whole checkpoint (model and optimizer inside)."""
SHARDED_FORMAT = 2
"""Format of the state.pt payload of a sharded checkpoint: the model and optimizer are in the
`torch.distributed.checkpoint` folder `TrialState.shards` names (`distributed.sharded`)."""
MANIFEST_FORMAT = 2
"""Format of manifest.json: 1 = size + sha256 of each file, 2 = size + crc32."""


@dataclass
class TrialState:
    step: int = 0
    model: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    rng_states: list = field(default_factory=list)
    """Each world rank's generator states (`trainer.rng.capture`: torch CPU and CUDA, numpy,
    Python), indexed by world rank. Older checkpoints hold the torch CPU state alone."""
    history: list = field(default_factory=list)
    """One dict of metrics per evaluation so far."""
    hparams: dict = field(default_factory=dict)
    """The trial's hyperparameters (so a checkpoint alone rebuilds its model)."""
    scaler: dict = field(default_factory=dict)
    """fp16's gradient scaler state (`torch.amp.GradScaler.state_dict`); empty otherwise."""
    shards: str = ""
    """A sharded checkpoint's model and optimizer: on disk the folder beside state.pt that holds
    them (`model`), once loaded its URI; `model` and `optimizer` are then empty. Empty for a
    whole checkpoint."""


def write_atomic(directory: str, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    with _removed_on_error(tmp), os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(directory, name))


@contextlib.contextmanager
def _removed_on_error(tmp: str):
    """The temporary file `tmp` is removed when the write into it fails (a full disk keeps none
    of its bytes)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entry(data: bytes, manifest_format: int = MANIFEST_FORMAT) -> dict:
    if manifest_format == 1:
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {"size": len(data), "crc32": zlib.crc32(data)}


OVERLAP_MIN_BYTES = 1 << 20
"""Writes at least this large have their CRC-32 computed on a helper thread meanwhile."""


class _ChecksummedWriter:
    """A binary file that keeps the size and CRC-32 of the bytes written through it: the
    manifest entry of state.pt comes from the write itself, not from reading the file back.
    A large chunk (a tensor's bytes) is checksummed on `helper` while this thread writes it:
    zlib and file writes both release the GIL, so with a free core the CRC costs no time."""

    def __init__(self, file, helper: Executor):
        self.file, self.helper, self.size, self.crc32 = file, helper, 0, 0
        self.error: OSError | None = None
        """The file's own error (a full disk): torch.save reports it as a RuntimeError of its
        zip writer ("unexpected pos ..."), which says nothing of the cause."""

    def write(self, data) -> int:
        try:
            return self._write(data)
        except OSError as e:
            self.error = e
            raise

    def _write(self, data) -> int:
        if len(data) < OVERLAP_MIN_BYTES:  # headers and pickles: not worth a hand-off
            self.crc32 = zlib.crc32(data, self.crc32)
            written = self.file.write(data)
        else:  # `data` stays valid until we return: wait for the CRC before that
            crc32 = self.helper.submit(zlib.crc32, data, self.crc32)
            written = self.file.write(data)
            self.crc32 = crc32.result()
        self.size += written
        return written

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict:
        return {"size": self.size, "crc32": self.crc32}


def save_state(state: TrialState, directory: str) -> dict:
    """Write state.pt atomically; returns its manifest entry."""
    version = SHARDED_FORMAT if state.shards else FORMAT_VERSION
    payload = {"format": version, **{k: v for k, v in state.__dict__.items() if k != "shards" or v}}
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    # The zip's own CRC-32s would be a second checksum pass that nothing reads (the setting is
    # thread-local, so other threads' torch.save calls keep theirs).
    with (
        _removed_on_error(tmp),
        os.fdopen(fd, "wb") as f,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="playbook-ckpt-crc") as helper,
        serialization_config.patch({"save.compute_crc32": False}),
    ):
        writer = _ChecksummedWriter(f, helper)
        try:
            torch.save(payload, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
    os.replace(tmp, os.path.join(directory, STATE_FILE))
    return writer.entry()


def save(state: TrialState, directory: str, metrics: dict, beside: dict[str, dict] | None = None) -> None:
    """Write the state into `directory`: state.pt, meta.json, then the manifest that commits them
    and the files `beside` ({path relative to the checkpoint: manifest entry}: a sharded
    checkpoint's shards, written by every rank)."""
    os.makedirs(directory, exist_ok=True)
    files = {**(beside or {}), STATE_FILE: save_state(state, directory)}
    meta = json.dumps({"step": state.step, "metrics": metrics}).encode()
    write_atomic(directory, META_FILE, meta)
    files[META_FILE] = entry(meta)
    commit(directory, files)


def write_manifest(directory: str) -> None:
    """Commit the files now in `directory` (for files written by other means than `save`)."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST_FILE and not name.endswith(".partial"):
            files[name] = file_entry(os.path.join(directory, name))
    commit(directory, files)


READ_CHUNK_BYTES = 8 << 20


def file_entry(path_or_file, manifest_format: int = MANIFEST_FORMAT) -> dict:
    """The manifest entry (`entry`) of a file, read in chunks (a shard may be larger than the
    memory one would spare for it): a path, or a binary file object."""
    if isinstance(path_or_file, str):
        with open(path_or_file, "rb") as f:
            return file_entry(f, manifest_format)
    size, crc32, sha256 = 0, 0, hashlib.sha256()
    while chunk := path_or_file.read(READ_CHUNK_BYTES):
        size += len(chunk)
        if manifest_format == 1:
            sha256.update(chunk)
        else:
            crc32 = zlib.crc32(chunk, crc32)
    if manifest_format == 1:
        return {"size": size, "sha256": sha256.hexdigest()}
    return {"size": size, "crc32": crc32}


def commit(directory: str, files: dict[str, dict]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    write_atomic(directory, MANIFEST_FILE, json.dumps(manifest, sort_keys=True).encode())


def verify(where: str, read: Callable[[str], bytes]) -> dict[str, bytes]:
    """The committed files of the checkpoint at `where`, read through `read(name)`; raises
    CheckpointError when the manifest is missing or a file is missing or differs from it."""
    listed = manifest(where, read)
    return check_contents(where, listed, read, list(listed["files"]))


def manifest(where: str, read: Callable[[str], bytes]) -> dict:
    """The checkpoint's manifest ({"format", "files": {name: entry}}); CheckpointError when it is
    missing, unreadable or lists no state.pt."""
    try:
        found = json.loads(read(MANIFEST_FILE))
        listed, manifest_format = found["files"], found["format"]
        if manifest_format not in (1, MANIFEST_FORMAT):
            raise ValueError(manifest_format)
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{where}: incomplete checkpoint (no valid {MANIFEST_FILE})") from None
    if STATE_FILE not in listed:
        raise CheckpointError(f"{where}: incomplete checkpoint ({MANIFEST_FILE} lists no {STATE_FILE})")
    return found


def check_contents(
    where: str, listed: dict, read: Callable[[str], bytes], names: list[str]
) -> dict[str, bytes]:
    """The files `names` of the checkpoint, each read whole and checked against the manifest
    `listed` (CheckpointError naming the first missing or different one)."""
    contents = {}
    for name in names:
        try:
            data = read(name)
        except OSError:
            raise CheckpointError(f"{where}: incomplete checkpoint ({name} is missing)") from None
        if entry(data, listed["format"]) != listed["files"][name]:
            raise CheckpointError(_differs(where, name))
        contents[name] = data
    return contents


def check_streamed(where: str, listed: dict, open_file: Callable[[str], BinaryIO], names: list[str]) -> None:
    """As `check_contents` (after `check_sizes`: every file is there), each file read in chunks
    and kept nowhere: a sharded checkpoint's shards, which may be large."""
    for name in names:
        with open_file(name) as f:
            if file_entry(f, listed["format"]) != listed["files"][name]:
                raise CheckpointError(_differs(where, name))


def _differs(where: str, name: str) -> str:
    return f"{where}: incomplete checkpoint ({name} does not match {MANIFEST_FILE})"


def check_sizes(where: str, listed: dict, size: Callable[[str], int]) -> None:
    """Every file of the manifest `listed` is there with its size (`size(name)`: from a listing,
    no read); CheckpointError naming the first missing or truncated one."""
    for name, want in sorted(listed["files"].items()):
        try:
            got = size(name)
        except OSError:
            raise CheckpointError(f"{where}: incomplete checkpoint ({name} is missing)") from None
        if got != want["size"]:
            raise CheckpointError(
                f"{where}: incomplete checkpoint ({name} has {got} bytes, "
                f"{MANIFEST_FILE} says {want['size']})"
            )


def _local_reader(directory: str) -> Callable[[str], bytes]:
    def read(name: str) -> bytes:
        with open(os.path.join(directory, name), "rb") as f:
            return f.read()

    return read


def is_complete(directory: str) -> bool:
    try:
        verify(directory, _local_reader(directory))
    except CheckpointError:
        return False
    return True


def load(directory: str) -> TrialState:
    """The state of a committed checkpoint directory (CheckpointError for a torn one)."""
    return load_verified(directory, _local_reader(directory))


def load_verified(where: str, read: Callable[[str], bytes], only: list[str] | None = None) -> TrialState:
    """The state of the committed checkpoint at `where`, after checking every file against its
    manifest (or only the files `only`, where the others were checked otherwise)."""
    listed = manifest(where, read)
    names = list(listed["files"]) if only is None else only
    return load_file(io.BytesIO(check_contents(where, listed, read, names)[STATE_FILE]), where)


def load_file(path_or_buffer, where: str = "") -> TrialState:
    """The state in a state.pt; a sharded one's `shards` resolved against `where`, the URI of
    its checkpoint folder."""
    payload = torch.load(path_or_buffer, weights_only=True, map_location="cpu")
    version = payload.pop("format", None)
    if version not in (FORMAT_VERSION, SHARDED_FORMAT):
        raise ValueError(f"checkpoint format {version}, expected {FORMAT_VERSION} or {SHARDED_FORMAT}")
    state = TrialState(**payload)
    if state.shards and where:
        state.shards = "/".join([where.rstrip("/"), state.shards])
    return state


def step_of(directory: str) -> int:
    with open(os.path.join(directory, META_FILE)) as f:
        return int(json.load(f)["step"])


def newest_committed(
    folders: list[str], reader_for: Callable[[str], Callable[[str], bytes]]
) -> tuple[str, dict[str, bytes]] | None:
    """The committed checkpoint with the highest step among `folders` (torn ones skipped), each
    read through `reader_for(folder)` (any filesystem): (its folder, its verified files)."""
    best: tuple[int, str, dict[str, bytes]] | None = None
    for folder in folders:
        read = reader_for(folder)
        try:
            files = verify(folder, read)
        except CheckpointError:
            continue
        step = int(json.loads(files.get(META_FILE) or read(META_FILE))["step"])
        if best is None or step > best[0]:
            best = (step, folder, files)
    return None if best is None else (best[1], best[2])


def latest_complete(directories: list[str]) -> str | None:
    """The local committed checkpoint directory with the highest step (torn ones skipped)."""
    found = newest_committed(directories, _local_reader)
    return None if found is None else found[0]
