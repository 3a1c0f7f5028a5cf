"""One evaluation pass on this rank's eval shard: fixed-shape batches padded with zero-weight
rows, weighted sums reduced over all ranks (exact for any batch size and world size), per-class
counts, and the per-example predictions.

A sharded model's forward is a collective (FSDP gathers each unit's parameters from every
rank), so under FSDP every rank runs as many forward passes as the rank with the most batches:
the others pass batches of zero-weight rows (`lockstep`), which count for nothing."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from service.distributed.sharding import is_sharded
from service.evaluation.metrics import WeightedSums, per_class
from service.evaluation.padding import pad_batch
from service.evaluation.predictions import PredictionLog


def evaluate(
    model: nn.Module,
    workload,
    batches: Iterable[dict],
    batch_size: int,
    device,
    predictions: PredictionLog | None = None,
) -> dict:
    """Metrics named `<metric>` (weighted means over real examples), `count`, and `per_class`
    (support, precision, recall with Wilson intervals) for classification workloads."""
    num_classes = getattr(workload, "num_classes", None)
    sums = WeightedSums(workload.metric_names, num_classes, device)
    was_training = model.training
    model.eval()
    if is_sharded(model):
        batches = lockstep(batches, device)
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in pad_batch(batch, batch_size).items()}
            outputs = workload.forward(model, batch)
            per_example = workload.metrics(outputs, batch)
            predicted = outputs.argmax(dim=1) if num_classes else None
            sums.add(per_example, batch["weight"], batch["label"], predicted)
            if predictions is not None:
                predictions.add(batch, outputs, per_example)
    model.train(was_training)
    sums.all_reduce()
    result = sums.result()
    if num_classes:
        result["per_class"] = per_class(sums.confusion)
    return result


def lockstep(batches: Iterable[dict], device) -> Iterator[dict]:
    """`batches`, then batches of zero-weight rows until every rank has run out: before each
    batch the ranks agree (one small all-gather) whether any still has one. A rank that had no
    batch at all takes the shapes of one from the lowest rank that has."""
    it = iter(batches)
    template = None
    while True:
        batch = next(it, None)
        if batch is not None:
            template = {k: v[:0] for k, v in batch.items()}
        mine = torch.tensor([batch is not None, template is not None], dtype=torch.int64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        has_batch, has_template = torch.stack(everyone).cpu().bool().unbind(dim=1)
        if not has_batch.any():
            return
        if not has_template.all():  # the lowest rank with a template sends its shapes
            shared = [template]
            dist.broadcast_object_list(shared, src=int(has_template.int().argmax()))
            template = shared[0]
        yield batch if batch is not None else template
