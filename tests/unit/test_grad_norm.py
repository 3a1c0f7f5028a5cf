"""The per-step gradient norm (`trainer.grad_norm`): torch's own functions are the reference
(bit for bit) and numpy the independent check of the value."""

import numpy as np
import torch
from torch import nn

from service.trainer.grad_norm import GradNorm


def model_with_grads(dtype=torch.float32, frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)
    if frozen:
        model[0].bias.requires_grad_(False)
    model(torch.randn(11, 7, dtype=dtype)).square().sum().backward()
    return model


def numpy_norm(model: nn.Module) -> float:
    grads = [p.grad.double().numpy().ravel() for p in model.parameters() if p.grad is not None]
    return float(np.sqrt(sum((g**2).sum() for g in grads)))


def test_the_norm_is_torchs_total_norm_bit_for_bit_and_numpys_value():
    model = model_with_grads()
    norm = GradNorm(model)
    assert norm.fused
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert torch.equal(norm.norm(), reference)
    assert abs(norm.norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_a_frozen_parameter_and_an_unset_gradient_are_left_out():
    model = model_with_grads(frozen=True)
    model[2].bias.grad = None
    assert abs(GradNorm(model).norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_mixed_dtypes_take_torchs_path():
    model = model_with_grads()
    grads = {name: p.grad.double() for name, p in model[2].named_parameters()}
    model[2].to(torch.float64)
    for name, p in model[2].named_parameters():
        p.grad = grads[name]
    norm = GradNorm(model)
    assert not norm.fused
    assert torch.equal(norm.norm(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def test_clipping_scales_as_torchs_clip_grad_norm():
    model, twin = model_with_grads(), model_with_grads()
    before = numpy_norm(model)
    total = GradNorm(model).clip(0.25 * before)
    reference = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.25 * before)
    assert torch.equal(total, reference)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert abs(numpy_norm(model) - 0.25 * before) < 1e-4 * before
    loose = GradNorm(model).clip(10 * before)  # above the norm: nothing changes
    assert abs(loose.item() - numpy_norm(model)) < 1e-5 * before
