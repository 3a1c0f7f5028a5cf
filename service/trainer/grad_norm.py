"""The gradients' global 2-norm, taken every step (the clipping verdict and `grad_clip_norm` read
it), and clipping to it.

The value is torch's `get_total_norm` bit for bit: the 2-norm of each gradient, stacked, and the
2-norm of that vector. torch's function first sorts the gradients by device and dtype and moves
each norm to the first device, a dozen small operations a step; where the model's trainable
parameters share one device and dtype (almost always) this does the same arithmetic in three,
which matters on a GPU, where each is a kernel launch."""

from __future__ import annotations

import torch
from torch import nn

FOREACH_DEVICES = ("cpu", "cuda")


class GradNorm:
    """The trainable parameters of `model` (in its order) and how to take their gradients' norm."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        kinds = {(p.device, p.dtype) for p in self.params}
        self.fused = len(kinds) == 1 and next(iter(kinds))[0].type in FOREACH_DEVICES

    def norm(self) -> torch.Tensor:
        """The global norm of the gradients that are set (a device scalar: no host sync)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or not self.fused:
            return torch.nn.utils.get_total_norm(grads)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def clip(self, max_norm: float) -> torch.Tensor:
        """The norm, after scaling the gradients by min(1, max_norm / (norm + 1e-6)) in place
        (`torch.nn.utils.clip_grad_norm_`); returns the norm before clipping."""
        total = self.norm()
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total)
        return total
