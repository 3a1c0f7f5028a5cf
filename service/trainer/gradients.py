"""The gradients of a step: where they are kept, their global 2-norm, taken every step (the
clipping verdict and `grad_clip_norm` read it), and clipping to it.

In a one-process CPU trial the gradients live in one flat buffer (`Gradients.zero` instead of
the optimizer's `zero_grad(set_to_none=True)`). Each parameter's `.grad` shares the buffer's
memory, backward accumulates into it in place, and the norm of the buffer is one operation. On
CPU every torch operation is a synchronous dispatch: a fresh gradient tensor per parameter per
step and a norm per parameter cost more than the whole update of a small model.

What a user of torch sees is unchanged, bit for bit:
- a parameter that received no gradient in a step (unused by this forward pass) has its
  `.grad` set to None after backward, so the optimizer skips it exactly as after
  `zero_grad(set_to_none=True)`: its version counter tells, as backward's in-place
  accumulation bumps it;
- the buffer is zeroed to -0.0, the additive identity, so each gradient is backward's own
  value, sign of zero included;
- the first step runs on torch's own gradients, and the buffer is made only if they were all
  dense (a sparse embedding's, even a functional one's, stays sparse); they are copied into it
  before their norm is taken, so every step's norm is the buffer's (a resumed run logs the
  same norms as an uninterrupted one, bit for bit);
- a gradient something else put in `.grad` (a hook) is normed where it is.
Under FSDP the parameters and their gradients are this rank's shards (DTensors): the global
norm is taken over every rank's shards (`sharded_norm`), and clipping scales each shard by the
same factor, torch's, so the norm and the clipped update are those of the whole model.
Torch's own gradients are kept on CUDA (freed between steps: peak memory), with several ranks
(DDP hands an undefined gradient on as a defined zero once `.grad` exists) and with the
workload's own optimizer (which may keep a `.grad` from one step to the next without a copy).

The norm of the buffer is torch's `get_total_norm` (the 2-norm of the per-parameter 2-norms)
up to rounding. Clipping always uses torch's arithmetic: the clipped gradients are bit for bit
those of `torch.nn.utils.clip_grad_norm_`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from service.distributed.sharding import is_dtensor

FOREACH_DEVICES = ("cpu", "cuda")


class Gradients:
    """The trainable parameters of `model` (in its order), their gradients, and their norm."""

    def __init__(self, model: nn.Module, buffer: bool = True):
        """`buffer`: keep the gradients in one buffer where it can (see the module docstring)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sharded = any(is_dtensor(p) for p in self.params)
        """FSDP's shards: every norm is taken over all ranks' shards (a collective)."""
        kinds = {(p.device, p.dtype) for p in self.params}
        self.fused = len(kinds) == 1 and next(iter(kinds))[0].type in FOREACH_DEVICES
        self.flat, self.grads, self.versions = None, [], []
        self.pending = buffer and self.fused and not self.sharded and self.params[0].device.type == "cpu"
        """The buffer is still to be made, after the first step shows the gradients are dense."""
        self.intact = False  # every set gradient is in the buffer (after `settle`)

    def zero(self, optimizer: torch.optim.Optimizer) -> None:
        """Start a step's gradients at zero: the flat buffer's (each `.grad` put back on it),
        or the optimizer's `zero_grad(set_to_none=True)` where there is none."""
        if self.flat is None:
            optimizer.zero_grad(set_to_none=True)
            return
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                p.grad = g
        self.flat.fill_(-0.0)
        self.versions = [g._version for g in self.grads]

    def settle(self) -> None:
        """After backward: the gradient of a parameter backward did not reach is None again.
        If something other than backward replaced a `.grad`, the buffer no longer holds every
        gradient and the norm is taken per gradient."""
        if self.pending:
            self.pending = False
            self.intact = self._move_to_buffer()
            return
        self.intact = self.flat is not None
        if not self.intact:
            return
        for p, g, v in zip(self.params, self.grads, self.versions, strict=True):
            if p.grad is not g:
                self.intact = False
            elif g._version == v:
                p.grad = None  # its zeros stay in the buffer and add nothing to the norm

    def _move_to_buffer(self) -> bool:
        """After the first step: make the buffer, if its gradients allow it, and move them
        into it (a copy: the same bits). Whether it was made."""
        self.flat, self.grads = _flat_grads(self.params)
        if self.flat is None:
            return False
        self.flat.fill_(-0.0)
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not None:
                g.copy_(p.grad)
                p.grad = g
        return True

    def norm(self) -> torch.Tensor:
        """The global norm of the gradients that are set (a device scalar: no host sync)."""
        return torch.linalg.vector_norm(self.flat) if self.intact else self.exact_norm()

    def exact_norm(self) -> torch.Tensor:
        """torch's `get_total_norm` bit for bit: the 2-norm of each gradient, stacked, and the
        2-norm of that vector. torch's function first sorts the gradients by device and dtype
        and moves each norm to the first device, a dozen small operations a step; where the
        trainable parameters share one device and dtype (almost always) this does the same
        arithmetic in three."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.sharded:
            return sharded_norm(grads)
        if not grads or not self.fused:
            return torch.nn.utils.get_total_norm(grads)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def clip(self, max_norm: float) -> torch.Tensor:
        """The norm, after scaling the gradients by min(1, max_norm / (norm + 1e-6)) in place
        (`torch.nn.utils.clip_grad_norm_`); returns the norm before clipping."""
        total = self.exact_norm()
        if self.sharded:  # torch's coefficient, applied to each rank's shards
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad.to_local() for p in self.params if p.grad is not None], coefficient)
        else:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total)
        return total


def sharded_norm(grads: list) -> torch.Tensor:
    """The global 2-norm of FSDP's sharded gradients: the 2-norm of this rank's shards (one
    foreach norm), squared, summed over the ranks of its shard group (one all-reduce), the square
    root. Replicas (HSDP's other dimension) hold copies, which are not summed. Taking the norm
    of the DTensors instead dispatches every operation through DTensor, a few milliseconds a step
    for a small transformer (bench.fsdp)."""
    squared = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g.to_local() for g in grads]))) ** 2
    mesh = grads[0].device_mesh
    dist.all_reduce(squared, group=mesh.get_group(mesh.ndim - 1))
    return squared.sqrt()


def _flat_grads(params: list[nn.Parameter]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """A buffer (unfilled) for every parameter's gradient (`params`: one device and dtype), and per
    parameter a tensor of its shape on the buffer's memory (not a view of it: each keeps its own
    version counter). None where a gradient (backward's own, from the step just done) is sparse,
    or a parameter is not contiguous (a gradient of its strides could not tile the buffer)."""
    backwards = [p.grad for p in params if p.grad is not None]
    if any(g.layout != torch.strided for g in backwards) or not all(p.is_contiguous() for p in params):
        return None, []
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    grads, offset = [], 0
    for p in params:
        g = torch.empty(0, dtype=flat.dtype, device=flat.device)
        g.set_(flat.untyped_storage(), offset, p.shape, p.stride())
        grads.append(g)
        offset += p.numel()
    return flat, grads
