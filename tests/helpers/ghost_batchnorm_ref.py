"""A plain-loop reference for ghost batch norm in training (independent of service/nn)."""

from __future__ import annotations

import torch

EPS = 1e-5


def random_batch(n: int, c: int, spatial: tuple[int, ...] = (5, 5), seed: int = 0) -> torch.Tensor:
    """Random input whose consecutive groups of 16 examples have very different means and scales,
    so statistics over one virtual batch are far from those over another or over the batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, *spatial, generator=g)
    group = torch.arange(n) // 16
    shape = (n,) + (1,) * (x.dim() - 1)
    return x * (1 + group.reshape(shape)) + 3.0 * group.reshape(shape)


def stat_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


def ref_train(x, weight, bias, running_mean, running_var, num_batches, virtual, momentum, eps=EPS):
    """Hand-written ghost BN in train mode: output, and the running stats after one update per chunk."""
    outs = []
    rm, rv, nb = running_mean.clone(), running_var.clone(), num_batches
    for start in range(0, x.shape[0], virtual):
        c = x[start : start + virtual]
        dims = stat_dims(c)
        n = c.numel() // c.shape[1]
        mean = c.mean(dim=dims)
        biased = ((c - per_channel(mean, c)) ** 2).sum(dim=dims) / n
        y = (c - per_channel(mean, c)) / torch.sqrt(per_channel(biased, c) + eps)
        outs.append(y * per_channel(weight, c) + per_channel(bias, c))
        unbiased = biased * n / (n - 1)
        nb += 1
        m = 1.0 / nb if momentum is None else momentum
        rm = (1 - m) * rm + m * mean.detach()
        rv = (1 - m) * rv + m * unbiased.detach()
    return torch.cat(outs), rm, rv, nb
