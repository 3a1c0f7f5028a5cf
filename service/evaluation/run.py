"""One evaluation pass on this rank's eval shard: fixed-shape batches padded with zero-weight
rows, weighted sums reduced over all ranks (exact for any batch size and world size), per-class
counts, and the per-example predictions."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

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
