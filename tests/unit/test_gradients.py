"""The per-step gradient norm (`trainer.gradients`): torch's own functions are the reference
(bit for bit) and numpy the independent check of the value."""

import numpy as np
import pytest
import torch
from torch import nn

from service.trainer.gradients import Gradients
from tests.helpers.two_branches import TwoBranches


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
    norm = Gradients(model)
    assert norm.fused
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert torch.equal(norm.norm(), reference)
    assert abs(norm.norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_a_frozen_parameter_and_an_unset_gradient_are_left_out():
    model = model_with_grads(frozen=True)
    model[2].bias.grad = None
    assert abs(Gradients(model).norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_mixed_dtypes_take_torchs_path():
    model = model_with_grads()
    grads = {name: p.grad.double() for name, p in model[2].named_parameters()}
    model[2].to(torch.float64)
    for name, p in model[2].named_parameters():
        p.grad = grads[name]
    norm = Gradients(model)
    assert not norm.fused
    assert torch.equal(norm.norm(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def test_clipping_scales_as_torchs_clip_grad_norm():
    model, twin = model_with_grads(), model_with_grads()
    before = numpy_norm(model)
    total = Gradients(model).clip(0.25 * before)
    reference = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.25 * before)
    assert torch.equal(total, reference)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert abs(numpy_norm(model) - 0.25 * before) < 1e-4 * before
    loose = Gradients(model).clip(10 * before)  # above the norm: nothing changes
    assert abs(loose.item() - numpy_norm(model)) < 1e-5 * before


def train_two_branches(steps: int, service: bool):
    """AdamW with weight decay (which moves a parameter even at a zero gradient, so a gradient
    left at zero instead of None shows), the heads alternating a, a, b. `service`: the step's
    gradients as `Gradients` keeps them; otherwise as a plain loop does. Returns the model, each
    step's norm, which parameters had a gradient at each step, and the Gradients."""
    torch.manual_seed(0)
    model = TwoBranches()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    grads = Gradients(model)
    norms, had = [], []
    for step in range(steps):
        x = torch.randn(5, 6)
        if service:
            grads.zero(opt)
        else:
            opt.zero_grad(set_to_none=True)
        model(x, "b" if step % 3 == 2 else "a").square().mean().backward()
        if service:
            grads.settle()
        norms.append(grads.norm().item())
        had.append([p.grad is not None for p in model.parameters()])
        opt.step()
    return model, norms, had, grads


def one_step(model: nn.Module, grads: Gradients, loss_of) -> None:
    grads.zero(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_of(model).backward()
    grads.settle()


def test_on_cpu_the_gradients_live_in_one_buffer_after_the_first_step_and_the_norm_is_torchs_value():
    model = TwoBranches()
    grads = Gradients(model)
    one_step(model, grads, lambda m: m(torch.randn(5, 6), "a").square().sum())
    assert grads.intact and model.b.weight.grad is None  # torch's gradients, moved into the buffer
    one_step(model, grads, lambda m: m(torch.randn(5, 6), "a").square().sum())
    assert grads.intact
    for p in model.a.parameters():
        assert p.grad.untyped_storage().data_ptr() == grads.flat.untyped_storage().data_ptr()
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert abs(grads.norm().item() - reference.item()) < 1e-6 * reference.item()
    assert abs(grads.norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_a_parameter_a_step_does_not_reach_is_skipped_by_the_optimizer_as_after_set_to_none():
    """Bit for bit the plain loop's weights, though AdamW's weight decay would move an unused
    head whose gradient were left at zero."""
    mine, norms, had, grads = train_two_branches(7, service=True)
    plain, plain_norms, plain_had, _ = train_two_branches(7, service=False)
    assert grads.intact
    assert had == plain_had
    assert [h[4] for h in had] == [False, False, True] * 2 + [False]  # head b's weight
    for p, q in zip(mine.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert norms == pytest.approx(plain_norms, rel=1e-6)


def test_a_negative_zero_gradient_keeps_its_sign():
    """The buffer starts each step at -0.0, the additive identity: +0.0 would turn backward's
    -0.0 into +0.0 (and SGD then moves a -0.0 weight to +0.0)."""
    c = torch.tensor([-0.0, 0.0, -1.0, 2.0])
    model = nn.Linear(4, 1, bias=False)
    grads = Gradients(model)
    for _ in range(2):
        one_step(model, grads, lambda m: (m.weight * c).sum())
    assert grads.intact
    assert torch.equal(torch.signbit(model.weight.grad[0]), torch.signbit(c))


def test_a_gradient_replaced_outside_backward_is_normed_where_it_is():
    model = TwoBranches()
    grads = Gradients(model)
    for replace in (False, True):
        grads.zero(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.randn(5, 6), "a").square().sum().backward()
        if replace:
            model.a.bias.grad = torch.full_like(model.a.bias, 3.0)  # e.g. a hook of the user's
        grads.settle()
    assert grads.flat is not None and not grads.intact
    assert abs(grads.norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


def test_a_non_contiguous_parameter_keeps_torchs_own_gradients():
    model = nn.Linear(4, 3)
    model.weight = nn.Parameter(torch.randn(4, 3).t())  # strides (1, 3)
    grads = Gradients(model)
    for _ in range(2):
        one_step(model, grads, lambda m: m(torch.randn(2, 4)).sum())
    assert grads.flat is None
    assert abs(grads.norm().item() - numpy_norm(model)) < 1e-5 * numpy_norm(model)


class FunctionalSparse(nn.Module):
    """A sparse lookup through `F.embedding`: no module says `sparse`."""

    def __init__(self):
        super().__init__()
        self.table, self.head = nn.Parameter(torch.randn(10, 3)), nn.Linear(3, 2)

    def forward(self, idx):
        return self.head(nn.functional.embedding(idx, self.table, sparse=True))


@pytest.mark.parametrize(
    "model", [lambda: nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 2)), FunctionalSparse]
)
def test_a_sparse_gradient_stays_sparse(model):
    model = model()
    grads = Gradients(model)
    for _ in range(2):
        one_step(model, grads, lambda m: m(torch.tensor([1, 4])).sum())
        assert next(model.parameters()).grad.is_sparse
    assert grads.flat is None


def test_without_buffer_the_gradients_are_torchs_own():
    """With several ranks or the workload's own optimizer (`trainer.setup`)."""
    model = TwoBranches()
    grads = Gradients(model, buffer=False)
    for _ in range(2):
        one_step(model, grads, lambda m: m(torch.randn(5, 6), "a").square().sum())
    assert grads.flat is None and model.b.weight.grad is None
