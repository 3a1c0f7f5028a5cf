"""A disk that fills up: a small tmpfs mounted for a test (as root), a ballast file that takes
all but a chosen number of its bytes, and a workload whose checkpoints have a known size (a
buffer of `CHECKPOINT_MIB` MiB in its state dict), so that a chosen checkpoint is the write
that meets ENOSPC (loaded as `tests.helpers.full_disk:HeavyDigits`)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import torch
from torch import nn

from service.workloads.digits import Digits

CHECKPOINT_MIB = 4
"""Bytes of every checkpoint beyond the digits model's own (a few KiB)."""


class Heavy(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("heavy", torch.zeros(CHECKPOINT_MIB << 18))  # float32: 4 bytes each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class HeavyDigits(Digits):
    name = "heavy_digits"

    def build_model(self, hparams) -> nn.Module:
        return Heavy(super().build_model(hparams))


@contextlib.contextmanager
def small_disk(folder, size_mib: int):
    """A tmpfs of `size_mib` MiB mounted at `folder` (created), unmounted at the end."""
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)], check=True)
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def free_bytes(folder) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill_leaving(folder, free: int) -> str:
    """A ballast file in `folder` that leaves `free` bytes of its filesystem free; its path."""
    path = os.path.join(folder, "ballast")
    size = free_bytes(folder) - free
    with open(path, "wb") as f:
        f.write(b"\0" * size)  # written, not truncated to size: tmpfs allocates sparse files lazily
    return path


def fill_up(folder) -> str:
    """A ballast file in `folder` that takes every free byte, written until the filesystem says
    it is full (something else may be writing to it meanwhile); its path."""
    path = os.path.join(folder, "ballast")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return path
