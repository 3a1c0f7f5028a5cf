"""Trial state on disk: model, optimizer, step (= schedule and data position), RNG states of
every rank, and the metrics history. Loaded with `weights_only=True` (no pickled code).

A checkpoint is committed by its manifest, written last: the size and sha256 of every other
file. A directory without a manifest, or whose files do not match it (a crash between two
writes, or a copy to storage cut off half way, in whatever order the copy went), is not a
checkpoint: `load` refuses it and `latest_complete` skips it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.errors import CheckpointError

STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class TrialState:
    step: int = 0
    model: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    rng_states: list = field(default_factory=list)
    """torch CPU RNG state of each world rank, indexed by world rank."""
    history: list = field(default_factory=list)
    """One dict of metrics per evaluation so far."""
    hparams: dict = field(default_factory=dict)
    """The trial's hyperparameters (so a checkpoint alone rebuilds its model)."""


def _write_atomic(directory: str, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(directory, name))


def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save(state: TrialState, directory: str, metrics: dict) -> None:
    """Write the state into `directory`: state.pt, meta.json, then the manifest that commits them."""
    os.makedirs(directory, exist_ok=True)
    payload = {"format": FORMAT_VERSION, **state.__dict__}
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, os.path.join(directory, STATE_FILE))
    _write_atomic(directory, META_FILE, json.dumps({"step": state.step, "metrics": metrics}).encode())
    write_manifest(directory)


def write_manifest(directory: str) -> None:
    """Commit the files now in `directory` (the last write of a checkpoint)."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST_FILE and not name.endswith(".partial"):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = _entry(f.read())
    manifest = {"format": FORMAT_VERSION, "files": files}
    _write_atomic(directory, MANIFEST_FILE, json.dumps(manifest, sort_keys=True).encode())


def verify(where: str, read: Callable[[str], bytes]) -> dict[str, bytes]:
    """The committed files of the checkpoint at `where`, read through `read(name)`; raises
    CheckpointError when the manifest is missing or a file is missing or differs from it."""
    try:
        manifest = json.loads(read(MANIFEST_FILE))
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{where}: incomplete checkpoint (no valid {MANIFEST_FILE})") from None
    if STATE_FILE not in listed:
        raise CheckpointError(f"{where}: incomplete checkpoint ({MANIFEST_FILE} lists no {STATE_FILE})")
    contents = {}
    for name, want in listed.items():
        try:
            data = read(name)
        except OSError:
            raise CheckpointError(f"{where}: incomplete checkpoint ({name} is missing)") from None
        if _entry(data) != want:
            raise CheckpointError(f"{where}: incomplete checkpoint ({name} does not match {MANIFEST_FILE})")
        contents[name] = data
    return contents


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


def load_verified(where: str, read: Callable[[str], bytes]) -> TrialState:
    return load_file(io.BytesIO(verify(where, read)[STATE_FILE]))


def load_file(path_or_buffer) -> TrialState:
    payload = torch.load(path_or_buffer, weights_only=True, map_location="cpu")
    version = payload.pop("format", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {version}, expected {FORMAT_VERSION}")
    return TrialState(**payload)


def step_of(directory: str) -> int:
    with open(os.path.join(directory, META_FILE)) as f:
        return int(json.load(f)["step"])


def latest_complete(directories: list[str]) -> str | None:
    """The committed checkpoint with the highest step among `directories` (torn ones skipped)."""
    complete = [d for d in directories if is_complete(d)]
    return max(complete, key=step_of, default=None)
