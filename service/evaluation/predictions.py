"""Per-example predictions of an evaluation: gathered from every rank, written by rank 0 as one
parquet file, so any metric can be recomputed, sliced or audited later from the file alone.

Columns: example_id (the workload's id_column), label, weight, split, step, `metric/<name>` for
each of the workload's per-example metrics and, for a classifier (`num_classes` set),
`prediction` (argmax of the logits) and `score` (its softmax probability), else `output` (the
model's output: a number, or a list of numbers per example) unless the workload keeps it out
(`outputs_in_predictions = False`). `weight` is the example's weight (1, or the workload's own:
a language model's token count)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from service.core import storage
from service.distributed import fence


class PredictionLog:
    """Collects this rank's real (weight > 0) rows of one evaluation."""

    def __init__(
        self, metric_names: tuple[str, ...] = (), num_classes: int | None = None, keep_outputs: bool = True
    ):
        self.num_classes = num_classes
        outputs = ("prediction", "score") if num_classes else ("output",) if keep_outputs else ()
        self.keys = ("example_id", "label", *outputs, "weight", *(f"metric/{m}" for m in metric_names))
        self.parts: list[dict[str, np.ndarray]] = []

    @classmethod
    def of(cls, workload) -> PredictionLog:
        """The log of `workload`'s evaluations: its metrics, and its outputs unless it keeps them
        out (`outputs_in_predictions = False`: a language model's per-token logits)."""
        keep = getattr(workload, "outputs_in_predictions", True)
        return cls(workload.metric_names, workload.num_classes, keep)

    def add(
        self,
        batch: dict[str, torch.Tensor],
        outputs: torch.Tensor,
        per_example: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Keep the real rows of a batch; `per_example` metric values become `metric/<name>`
        columns (what the sampled-eval bias check compares)."""
        real = batch["weight"] > 0
        columns = {"example_id": batch["example_id"], "label": batch["label"], **self._outputs(outputs)}
        columns["weight"] = batch["weight"]
        for name, values in (per_example or {}).items():
            columns[f"metric/{name}"] = values.detach().double()
        self.parts.append({k: v[real].cpu().numpy() for k, v in columns.items() if k in self.keys})

    def _outputs(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.num_classes:
            score, prediction = torch.softmax(outputs.detach().float(), dim=1).max(dim=1)
            return {"prediction": prediction, "score": score}
        if "output" not in self.keys:
            return {}
        flat = outputs.detach().float().reshape(len(outputs), -1)
        return {"output": flat[:, 0] if flat.shape[1] == 1 else flat}

    def gather(self) -> dict[str, np.ndarray] | None:
        """All ranks' rows on rank 0 (None elsewhere), in world-rank order."""
        mine = {k: _concat([p[k] for p in self.parts]) for k in self.keys}
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is None:
            return None
        return {k: _concat([r[k] for r in everyone]) for k in mine}


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    arrays = [a for a in arrays if len(a)]
    return np.concatenate(arrays) if arrays else np.array([])


def _column(values: np.ndarray) -> pa.Array:
    """int64 for integers, float64 otherwise; a fixed-size list per row for several values."""
    flat = values.reshape(len(values), -1)
    kind = np.int64 if np.issubdtype(values.dtype, np.integer) or values.dtype == bool else np.float64
    if values.ndim <= 1:
        return pa.array(values.astype(kind))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(kind).ravel()), flat.shape[1])


TYPES = {"example_id": np.int64, "prediction": np.int64, "score": np.float32, "weight": np.float32}
"""Columns whose type is fixed, whatever the workload."""


def write(uri: str, rows: dict[str, np.ndarray], split: str, step: int) -> None:
    n = len(rows["example_id"])
    columns = {k: pa.array(v.astype(TYPES[k])) if k in TYPES else _column(v) for k, v in rows.items()}
    table = pa.table(
        {
            **{k: columns[k] for k in rows if not k.startswith("metric/")},
            "split": pa.array([split] * n, pa.string()),
            "step": pa.array(np.full(n, step, dtype=np.int64)),
            **{k: columns[k] for k in rows if k.startswith("metric/")},
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    fence.check(uri)
    storage.write_bytes_atomic(uri, buf.getvalue())
