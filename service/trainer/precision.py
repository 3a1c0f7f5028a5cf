"""Mixed precision (`training.precision`): the forward passes under `torch.autocast` on the
trial's device type (bf16 or fp16), and with fp16 a `torch.amp.GradScaler` that scales the loss
before backward, unscales the gradients before clipping and skips an update whose gradients
overflowed. Its state goes into the checkpoint (`TrialState.scaler`)."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INIT_SCALE = 2.0**16
"""fp16's first loss scale (torch's default; halved after each overflowing step, doubled after
2000 steps without one)."""


class Precision:
    """What a precision changes in a step: the autocast context, the backward pass, the
    unscale before clipping and the update."""

    def __init__(self, name: str, device, autocast: bool = True):
        """`autocast` False: the model computes in the precision's dtype itself (FSDP's
        mixed-precision policy gathers its parameters in it), so no autocast is entered."""
        self.name = name
        self.device_type = torch.device(device).type
        self.dtype = DTYPES.get(name) if autocast else None
        self.scaler = (
            torch.amp.GradScaler(self.device_type, init_scale=INIT_SCALE) if name == "fp16" else None
        )

    def autocast(self):
        """The forward pass's context (training and evaluation alike); none under fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients at their true scale (before clipping reads their norm)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update; under fp16 skipped when the gradients hold inf/NaN, and the scale adapted."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
