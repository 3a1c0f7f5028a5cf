"""A plain-torch reference for the `lm` workload's evaluation: each sequence of the corpus on its
own, unpadded, through the model; the summed token cross-entropy and the number of real tokens."""

from __future__ import annotations

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F


def corpus_rows(split_dir: str) -> list[dict]:
    """The split's rows in file order (the order of its evaluation's predictions)."""
    return pq.read_table(split_dir).to_pylist()


def plain_token_losses(model: torch.nn.Module, rows: list[dict]) -> tuple[float, int]:
    """(summed cross-entropy in float64, real tokens): a sequence's context byte and its real
    bytes but the last go in, its real bytes are the targets."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for r in rows:
            real = list(r["bytes"][: r["num_tokens"]])
            logits = model(torch.tensor([[r["context"], *real[:-1]]]))[0]
            total += F.cross_entropy(logits.double(), torch.tensor(real), reduction="sum").item()
            count += len(real)
    model.train(was_training)
    return total, count
