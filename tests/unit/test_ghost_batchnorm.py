"""Ghost batch norm vs hand-written math: per-virtual-batch outputs, running stats, grads, conversion."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.core.errors import SpecError
from service.nn.ghost_batchnorm import (
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    convert_to_ghost,
    ghost_group,
    has_batchnorm,
)
from service.study import spec
from service.workloads.digits import SmallConvNet
from tests.helpers.ghost_batchnorm_ref import EPS, per_channel, random_batch, ref_train
from tests.helpers.studies import MINIMAL_STUDY as MINIMAL

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _ghost(cls, c, virtual, momentum=0.1, seed=1):
    bn = cls(c, momentum=momentum, virtual_batch_size=virtual)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(c, generator=g))
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
    return bn


def _check_train(bn, x, virtual):
    w, b = bn.weight.detach().double(), bn.bias.detach().double()
    rm0, rv0 = bn.running_mean.double(), bn.running_var.double()
    nb0 = int(bn.num_batches_tracked)
    y = bn(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y_ref, rm, rv, nb = ref_train(x.double(), w, b, rm0, rv0, nb0, virtual, bn.momentum)
    torch.testing.assert_close(y.double(), y_ref, **TOL)
    torch.testing.assert_close(bn.running_mean.double(), rm, **TOL)
    torch.testing.assert_close(bn.running_var.double(), rv, **TOL)
    assert int(bn.num_batches_tracked) == nb
    return y


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize(
    "n,chunks", [(256, 4), (192, 3)], ids=["four-virtual-batches", "three-virtual-batches"]
)
def test_2d_train_normalises_each_virtual_batch(n, chunks, momentum):
    bn = _ghost(GhostBatchNorm2d, 3, virtual=64, momentum=momentum)
    bn.num_batches_tracked.fill_(2)  # so the cumulative average starts mid-way
    plain = nn.BatchNorm2d(3, momentum=momentum)
    plain.load_state_dict(bn.state_dict())
    x = random_batch(n, 3)
    y = _check_train(bn, x, virtual=64)
    assert int(bn.num_batches_tracked) == 2 + chunks
    # Whole-batch BN is far from this: the test data can tell the two apart.
    y_plain = plain(x)
    assert (y - y_plain).abs().max() > 0.1
    assert (bn.running_mean - plain.running_mean).abs().max() > 0.1


def test_2d_batch_of_one_virtual_batch_is_plain_batchnorm():
    bn = _ghost(GhostBatchNorm2d, 3, virtual=64)
    plain = nn.BatchNorm2d(3)
    plain.load_state_dict(bn.state_dict())
    x = random_batch(64, 3)
    y = _check_train(bn, x, virtual=64)
    torch.testing.assert_close(y, plain(x), **TOL)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(bn.state_dict()[key], value, **TOL)


def test_1d_on_flat_features():
    bn = _ghost(GhostBatchNorm1d, 6, virtual=32)
    x = random_batch(96, 6, spatial=())  # chunks of 32, 32, 32
    y = _check_train(bn, x, virtual=32)
    assert x.shape == (96, 6) and int(bn.num_batches_tracked) == 3
    assert (y - F.batch_norm(x, None, None, bn.weight, bn.bias, training=True)).abs().max() > 0.1


def test_1d_on_sequences():
    bn = _ghost(GhostBatchNorm1d, 4, virtual=16)
    _check_train(bn, random_batch(48, 4, spatial=(7,)), virtual=16)


@pytest.mark.parametrize("n", [80, 100, 48], ids=["remainder-of-16", "remainder-of-36", "below-virtual"])
def test_training_batch_not_a_whole_number_of_virtual_batches_raises(n):
    """80 = 64 + 16 would normalise 16 examples with their own statistics; 48 (no group of
    ranks) would normalise over 48: both refused, and nothing is updated."""
    bn = _ghost(GhostBatchNorm2d, 3, virtual=64)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError, match=f"a batch of {n} is not a whole number of virtual batches of 64"):
        bn(random_batch(n, 3))
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key
    bn.eval()(random_batch(n, 3))  # eval mode: running statistics, any batch size


def test_ghost_group_needs_sizes_that_divide():
    assert ghost_group(128, 64) is None and ghost_group(64, 64) is None
    with pytest.raises(ValueError, match="virtual batch 64 does not divide the per-worker batch 80"):
        ghost_group(80, 64)
    with pytest.raises(
        ValueError, match="virtual batch 64 is not a whole number of per-worker batches of 24"
    ):
        ghost_group(24, 64)
    with pytest.raises(ValueError, match="needs a process group"):
        ghost_group(32, 64)  # no process group in this process


def test_gradients_match_autograd_through_reference():
    bn = _ghost(GhostBatchNorm2d, 3, virtual=64)
    x = random_batch(192, 3).requires_grad_()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    (bn(x) * upstream).sum().backward()

    x_ref = x.detach().double().requires_grad_()
    w_ref = bn.weight.detach().double().requires_grad_()
    b_ref = bn.bias.detach().double().requires_grad_()
    zeros = torch.zeros(3, dtype=torch.float64)
    y_ref = ref_train(x_ref, w_ref, b_ref, zeros, zeros, 0, 64, 0.1)[0]
    (y_ref * upstream.double()).sum().backward()

    assert x.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bn.weight.grad.double(), w_ref.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(bn.bias.grad.double(), b_ref.grad, atol=1e-3, rtol=1e-4)


def test_eval_uses_running_stats_and_leaves_them():
    bn = _ghost(GhostBatchNorm2d, 3, virtual=64).eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = random_batch(256, 3)
    y = bn(x)
    rm, rv = per_channel(before["running_mean"], x), per_channel(before["running_var"], x)
    expected = (x - rm) / torch.sqrt(rv + EPS) * per_channel(before["weight"], x) + per_channel(
        before["bias"], x
    )
    torch.testing.assert_close(y, expected, **TOL)
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_state_dict_is_batchnorms():
    ghost = GhostBatchNorm2d(5, virtual_batch_size=8)
    plain = nn.BatchNorm2d(5)
    assert list(ghost.state_dict()) == list(plain.state_dict())
    ghost.load_state_dict(plain.state_dict())  # strict: a plain BN checkpoint loads as is
    with pytest.raises(ValueError, match="virtual_batch_size"):
        GhostBatchNorm1d(5, virtual_batch_size=0)


def _ref_small_conv_net(model: SmallConvNet, x: torch.Tensor, virtual: int) -> torch.Tensor:
    """SmallConvNet's forward written out with the hand-written ghost BN (float64)."""
    conv1, bn1, _, conv2, bn2 = list(model.features)[:5]

    def bn(h, layer):
        p = [t.detach().double() for t in (layer.weight, layer.bias, layer.running_mean, layer.running_var)]
        return ref_train(h, *p, 0, virtual, layer.momentum, layer.eps)[0]

    h = F.relu(bn(F.conv2d(x, conv1.weight.detach().double(), padding=1), bn1))
    h = F.relu(bn(F.conv2d(h, conv2.weight.detach().double(), padding=1, stride=2), bn2))
    h = h.mean(dim=(2, 3))
    return F.linear(h, model.head.weight.detach().double(), model.head.bias.detach().double())


def test_convert_small_conv_net():
    torch.manual_seed(0)
    model = SmallConvNet(10, 4)
    original = copy.deepcopy(model)
    params_before = {n: p for n, p in model.named_parameters()}
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    converted = convert_to_ghost(model, 64)

    assert converted is model and has_batchnorm(converted)
    ghosts = [m for m in converted.modules() if isinstance(m, GhostBatchNorm2d)]
    assert len(ghosts) == 2 and all(m.virtual_batch_size == 64 for m in ghosts)
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    state_after = converted.state_dict()
    assert list(state_after) == list(state_before)
    for key, value in state_before.items():
        assert torch.equal(state_after[key], value), key
    for name, p in converted.named_parameters():
        assert p is params_before[name], name  # the same Parameter objects (an optimizer keeps working)
    assert converted.training

    x = random_batch(256, 1, spatial=(8, 8), seed=3)
    y = converted(x)
    y_original = original(x)
    assert (y - y_original).abs().max() > 1e-2
    torch.testing.assert_close(
        y.double(), _ref_small_conv_net(original, x.double(), 64), atol=1e-4, rtol=1e-4
    )


def test_convert_keeps_layer_settings():
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Sequential(nn.BatchNorm1d(4, eps=1e-3, momentum=None, affine=False, track_running_stats=False)),
    )
    convert_to_ghost(model, 16)
    ghost = model[1][0]
    assert isinstance(ghost, GhostBatchNorm1d)
    assert (ghost.eps, ghost.momentum, ghost.affine, ghost.track_running_stats) == (1e-3, None, False, False)
    assert (
        ghost.weight is None
        and ghost.running_mean is None
        and model.state_dict().keys() == {"0.weight", "0.bias"}
    )


def test_convert_without_batchnorm_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert not has_batchnorm(model)
    with pytest.raises(ValueError, match="BatchNorm"):
        convert_to_ghost(model, 64)


def test_spec_fields_default_and_load():
    s = spec.load_dict(copy.deepcopy(MINIMAL))
    assert (s.training.ghost_batch_norm, s.training.virtual_batch_size) == (False, 64)
    raw = copy.deepcopy(MINIMAL)
    raw["training"].update(ghost_batch_norm=True, virtual_batch_size=16)
    s = spec.load_text(spec.dump_yaml(spec.load_dict(raw)))
    assert (s.training.ghost_batch_norm, s.training.virtual_batch_size) == (True, 16)


def test_spec_rejects_zero_virtual_batch_size():
    raw = copy.deepcopy(MINIMAL)
    raw["training"]["virtual_batch_size"] = 0
    with pytest.raises(SpecError) as e:
        spec.load_dict(raw)
    assert str(e.value).startswith("training.virtual_batch_size: "), str(e.value)


@pytest.mark.parametrize(
    "batch_size,hosts,workers,virtual,message",
    [
        (
            80,
            1,
            1,
            64,
            "training.virtual_batch_size: 64 does not divide the per-worker batch of 80 (training.batch_size "
            "80 over 1 workers); nearest that work: virtual_batch_size 40 or 80, or batch_size 64 or 128",
        ),
        (
            320,
            2,
            2,
            64,
            "training.virtual_batch_size: 64 does not divide the per-worker batch of 80 (training.batch_size "
            "320 over 4 workers); nearest that work: virtual_batch_size 40 or 80, or batch_size 256 or 512",
        ),
        (
            96,
            1,
            4,
            64,
            "training.virtual_batch_size: 64 is not a whole number of per-worker batches of 24 "
            "(training.batch_size 96 over 4 workers); nearest that work: virtual_batch_size 48 or 96, "
            "or batch_size 64 or 128",
        ),
        (
            96,
            3,
            1,
            64,
            "training.virtual_batch_size: 64 needs groups of 2 workers' batches of 32, and 3 workers do "
            "not split so (training.batch_size 96 over 3 workers); nearest that work: virtual_batch_size "
            "32 or 96, or batch_size 192",
        ),
    ],
    ids=["remainder-chunk", "remainder-chunk-per-worker", "not-whole-batches", "groups-do-not-tile"],
)
def test_spec_refuses_virtual_batches_the_batches_do_not_make(batch_size, hosts, workers, virtual, message):
    raw = copy.deepcopy(MINIMAL)
    raw["training"].update(batch_size=batch_size, ghost_batch_norm=True, virtual_batch_size=virtual)
    raw["scaling"] = {"num_hosts": hosts, "workers_per_host": workers}
    with pytest.raises(SpecError) as e:
        spec.load_dict(raw)
    assert str(e.value) == message
    raw["training"]["ghost_batch_norm"] = False  # the sizes only matter to ghost batch norm
    spec.load_dict(raw)


@pytest.mark.parametrize(
    "batch_size,world,virtual",
    [(256, 4, 64), (64, 1, 64), (64, 4, 64), (128, 8, 32), (32, 4, 16)],
    ids=["one-per-worker", "one-worker", "group-of-4", "groups-of-2", "groups-of-2-of-4"],
)
def test_spec_accepts_virtual_batches_the_batches_make(batch_size, world, virtual):
    raw = copy.deepcopy(MINIMAL)
    raw["training"].update(batch_size=batch_size, ghost_batch_norm=True, virtual_batch_size=virtual)
    raw["scaling"] = {"num_hosts": 1, "workers_per_host": world}
    assert spec.load_dict(raw).training.virtual_batch_size == virtual
