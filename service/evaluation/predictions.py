"""Per-example predictions of an evaluation: gathered from every rank, written by rank 0 as one
parquet file (example_id, label, prediction, score, weight, split, step), so any metric can be
recomputed, sliced or audited later from the file alone."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from service import storage

BASE_COLUMNS = ("example_id", "label", "prediction", "score", "weight")


class PredictionLog:
    """Collects this rank's real (weight > 0) rows of one evaluation."""

    def __init__(self, metric_names: tuple[str, ...] = ()):
        self.keys = BASE_COLUMNS + tuple(f"metric/{m}" for m in metric_names)
        self.parts: list[dict[str, np.ndarray]] = []

    def add(
        self,
        batch: dict[str, torch.Tensor],
        outputs: torch.Tensor,
        per_example: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Keep the real rows of a batch; `per_example` metric values become `metric/<name>`
        columns (what the sampled-eval bias check compares)."""
        real = batch["weight"] > 0
        probs = torch.softmax(outputs.detach().float(), dim=1)
        score, prediction = probs.max(dim=1)
        self.parts.append(
            {
                "example_id": batch["example_id"][real].cpu().numpy(),
                "label": batch["label"][real].cpu().numpy(),
                "prediction": prediction[real].cpu().numpy(),
                "score": score[real].cpu().numpy(),
                "weight": batch["weight"][real].cpu().numpy(),
            }
        )
        for name, values in (per_example or {}).items():
            self.parts[-1][f"metric/{name}"] = values.detach()[real].double().cpu().numpy()

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


def write(uri: str, rows: dict[str, np.ndarray], split: str, step: int) -> None:
    n = len(rows["example_id"])
    table = pa.table(
        {
            "example_id": pa.array(rows["example_id"].astype(np.int64)),
            "label": pa.array(rows["label"].astype(np.int64)),
            "prediction": pa.array(rows["prediction"].astype(np.int64)),
            "score": pa.array(rows["score"].astype(np.float32)),
            "weight": pa.array(rows["weight"].astype(np.float32)),
            "split": pa.array([split] * n, pa.string()),
            "step": pa.array(np.full(n, step, dtype=np.int64)),
            **{k: pa.array(v.astype(np.float64)) for k, v in rows.items() if k.startswith("metric/")},
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes_atomic(uri, buf.getvalue())
