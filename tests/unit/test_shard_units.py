"""Which modules FSDP shards as units (`Workload.shard_units`): by default every top-level child
with parameters, a ModuleList's children in its place, a child sharing a parameter with another
left to the root; the lm workload's are its transformer blocks. And no process pays for FSDP's
imports until it shards a model."""

from __future__ import annotations

from torch import nn

from service import workloads
from service.workloads.base import top_level_units
from tests.helpers.processes import imported_along


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.act = nn.ReLU()  # no parameters: nothing to shard
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: both stay in the root unit


def test_default_units_expand_lists_and_leave_tied_children_to_the_root():
    model = Tied()
    assert top_level_units(model) == [model.blocks[0], model.blocks[1], model.mlp]


def test_the_lm_workloads_units_are_its_blocks():
    lm = workloads.get("lm")
    model = lm.build_model({"depth": 3, "width": 8, "heads": 2, "context": 8})
    assert lm.shard_units(model) == list(model.blocks) and len(model.blocks) == 3


def test_no_process_imports_fsdp_until_it_shards_a_model():
    """torch's FSDP, DTensor and DCP modules take most of a second to import: importing the
    service's trainer, launch and offline evaluation must not import them. (torch itself still
    imports torch._dynamo, and with it FSDP's modules, as a process builds its first optimizer,
    whatever it trains: this guards only what the service's own imports add.)"""
    imports = ["service.trainer.loop", "service.orchestration.launch", "service.evaluation.offline"]
    fsdp = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint"]
    assert imported_along(imports, fsdp) == []
