"""Ghost batch norm over a group of ranks (per-worker batch < virtual batch), on CPU gloo groups:
outputs, input and parameter gradients and running statistics against a hand-written BatchNorm
over each group's concatenated batch, and train() normalising over both ranks' batches."""

from __future__ import annotations

import torch

from service.distributed.topology import Topology
from service.nn.ghost_batchnorm import GhostBatchNorm1d, GhostBatchNorm2d, ghost_group
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import train
from service.workloads.digits import Digits
from tests.helpers.ghost_batchnorm_ref import random_batch, ref_train
from tests.helpers.gloo import run_gloo
from tests.helpers.studies import study_dict

STEPS = 2


def inputs(world: int, per: int, c: int, spatial: tuple[int, ...]):
    """Each step's input and upstream gradient over all ranks (rank r owns rows r*per ...)."""
    g = torch.Generator().manual_seed(7)
    xs = [random_batch(world * per, c, spatial, seed=step) for step in range(STEPS)]
    ups = [torch.randn(x.shape, generator=g) for x in xs]
    return xs, ups


def layer_rank(rank, world, virtual, momentum, c, spatial, xs, ups):
    """One ghost layer over this rank's rows; STEPS forward/backward passes."""
    per = xs[0].shape[0] // world
    cls = GhostBatchNorm2d if len(spatial) == 2 else GhostBatchNorm1d
    bn = cls(c, momentum=momentum, virtual_batch_size=virtual, group=ghost_group(per, virtual))
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, c))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, c))
    out = {"y": [], "x_grad": [], "weight_grad": [], "bias_grad": []}
    for x, up in zip(xs, ups, strict=True):
        mine = x[rank * per : (rank + 1) * per].clone().requires_grad_()
        bn.zero_grad()
        y = bn(mine)
        (y * up[rank * per : (rank + 1) * per]).sum().backward()
        for key, value in (("y", y), ("x_grad", mine.grad), ("weight_grad", bn.weight.grad)):
            out[key].append(value.detach().clone())
        out["bias_grad"].append(bn.bias.grad.clone())
    out["state"] = {k: v.clone() for k, v in bn.state_dict().items()}
    bn.eval()  # eval mode: running statistics, no collective, any batch size
    out["eval"] = bn(xs[0][:3]).detach()
    return out


def check_groups(results, world, virtual, momentum, c, xs, ups):
    per = xs[0].shape[0] // world
    group_size = virtual // per
    weight = torch.linspace(0.5, 1.5, c, dtype=torch.float64)
    bias = torch.linspace(-1.0, 1.0, c, dtype=torch.float64)
    for first in range(0, world, group_size):
        ranks = range(first, first + group_size)
        rows = slice(first * per, (first + group_size) * per)
        rm, rv, nb = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64), 0
        for step, (x, up) in enumerate(zip(xs, ups, strict=True)):
            # BatchNorm over the group's concatenated batch, by hand, in float64.
            x_ref = x[rows].double().requires_grad_()
            w_ref, b_ref = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            y_ref, rm, rv, nb = ref_train(x_ref, w_ref, b_ref, rm, rv, nb, virtual, momentum)
            (y_ref * up[rows].double()).sum().backward()
            y = torch.cat([results[r]["y"][step] for r in ranks])
            x_grad = torch.cat([results[r]["x_grad"][step] for r in ranks])
            torch.testing.assert_close(y.double(), y_ref.detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x_grad.double(), x_ref.grad, atol=1e-4, rtol=1e-4)
            # Each rank's parameter gradient is its rows' share (DDP sums them over ranks).
            for name, ref in (("weight_grad", w_ref.grad), ("bias_grad", b_ref.grad)):
                total = sum(results[r][name][step].double() for r in ranks)
                torch.testing.assert_close(total, ref, atol=1e-3, rtol=1e-4)
        for r in ranks:
            state = results[r]["state"]
            torch.testing.assert_close(state["running_mean"].double(), rm, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state["running_var"].double(), rv, atol=1e-5, rtol=1e-5)
            assert int(state["num_batches_tracked"]) == nb == STEPS
            expected_eval = (xs[0][:3] - _c(state["running_mean"], xs[0])) / torch.sqrt(
                _c(state["running_var"], xs[0]) + 1e-5
            ) * _c(weight.float(), xs[0]) + _c(bias.float(), xs[0])
            torch.testing.assert_close(results[r]["eval"], expected_eval, atol=1e-5, rtol=1e-5)


def _c(v, x):
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


def test_groups_of_two_of_four_ranks_match_batchnorm_over_each_group(tmp_path):
    world, virtual, c, spatial = 4, 16, 3, (4, 4)
    xs, ups = inputs(world, 8, c, spatial)
    results = run_gloo(layer_rank, world, tmp_path, virtual, 0.1, c, spatial, xs, ups)
    check_groups(results, world, virtual, 0.1, c, xs, ups)
    # The two groups normalise different data: their statistics differ.
    assert not torch.allclose(results[0]["state"]["running_mean"], results[2]["state"]["running_mean"])


def test_group_of_all_ranks_1d_cumulative(tmp_path):
    world, virtual, c, spatial = 2, 32, 5, ()
    xs, ups = inputs(world, 16, c, spatial)
    results = run_gloo(layer_rank, world, tmp_path, virtual, None, c, spatial, xs, ups)
    check_groups(results, world, virtual, None, c, xs, ups)


# ------------------------------------------------------------------ train() on two gloo ranks

SEEN: list[dict] = []


class RecordingDigits(Digits):
    """Digits that records the first BN layer's input and output in the first training step."""

    def build_model(self, hparams):
        model = super().build_model(hparams)
        conv, bn, relu = model.features[0], model.features[1], model.features[2]
        SEEN.append({"weight": bn.weight.detach().clone(), "bias": bn.bias.detach().clone()})

        def keep(key):
            def hook(module, args, output=None):
                if model.training and key not in SEEN[-1]:
                    SEEN[-1][key] = (args[0] if output is None else output).detach().clone()

            return hook

        conv.register_forward_hook(keep("bn_input"))
        relu.register_forward_pre_hook(keep("bn_output"))
        return model


def train_rank(rank, world, digits_dir, storage):
    raw = study_dict(
        digits_dir,
        storage,
        workload=f"{__name__}:RecordingDigits",
        scaling={"num_hosts": 1, "workers_per_host": world},
        training={
            "max_train_steps": 2,
            "eval_every_steps": 2,
            "batch_size": 32,
            "schedule": {"kind": "constant"},
            "ghost_batch_norm": True,
            "virtual_batch_size": 32,  # each worker has 16: the group of both ranks makes 32
        },
    )
    plan = TrialPlan(
        spec.load_dict(raw), "r1-0", "explore", {"learning_rate": 0.1, "momentum": 0.9, "width": 4}
    )
    topo = Topology(
        world_rank=rank, world_size=world, host_rank=0, num_hosts=1, local_rank=rank, workers_per_host=world
    )
    summary = train(plan, topo, NullReporter())
    return {**SEEN[-1], "status": summary["status"]}


class NullReporter:
    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def test_train_normalises_over_the_group_of_ranks(digits_dir, tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    r0, r1 = run_gloo(train_rank, 2, tmp_path, digits_dir, str(storage))
    assert r0["status"] == r1["status"] == "finished"
    assert r0["bn_input"].shape[0] == r1["bn_input"].shape[0] == 16
    x = torch.cat([r0["bn_input"], r1["bn_input"]]).double()
    zero = torch.zeros(x.shape[1], dtype=torch.float64)
    expected = ref_train(x, r0["weight"].double(), r0["bias"].double(), zero, zero + 1, 0, 32, 0.1)[0]
    got = torch.cat([r0["bn_output"], r1["bn_output"]]).double()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # Each rank alone would have normalised its 16 with their own statistics.
    alone = ref_train(
        r0["bn_input"].double(), r0["weight"].double(), r0["bias"].double(), zero, zero, 0, 16, 0.1
    )
    assert (alone[0] - expected[:16]).abs().max() > 1e-2
