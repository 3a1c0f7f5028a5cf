"""Trial state on disk: model, optimizer, step (= schedule and data position), RNG states of
every rank, and the metrics history. Loaded with `weights_only=True` (no pickled code)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch

STATE_FILE = "state.pt"
META_FILE = "meta.json"
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


def save(state: TrialState, directory: str, metrics: dict) -> None:
    """Write the state into `directory`; state.pt appears whole or not at all."""
    os.makedirs(directory, exist_ok=True)
    payload = {"format": FORMAT_VERSION, **state.__dict__}
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, os.path.join(directory, STATE_FILE))
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({"step": state.step, "metrics": metrics}, f)


def load(directory: str) -> TrialState:
    return load_file(os.path.join(directory, STATE_FILE))


def load_file(path_or_buffer) -> TrialState:
    payload = torch.load(path_or_buffer, weights_only=True, map_location="cpu")
    version = payload.pop("format", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {version}, expected {FORMAT_VERSION}")
    return TrialState(**payload)
