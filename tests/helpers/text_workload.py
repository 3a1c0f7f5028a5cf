"""A test workload whose pixels are written as text (loaded as `tests.helpers.text_workload:TextDigits`):
`to_batch` parses them, so a value like 'n/a' fails only in the row that holds it. Each model
it builds (one per attempt of a trial, per rank) leaves a file in its `attempts_dir`."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pyarrow as pa
import torch

from service.workloads.digits import Digits


class TextDigits(Digits):
    name = "text_digits"
    column_types = {"example_id": "integer", "label": "integer"}  # pixels: not declared
    hparam_defaults = {**Digits.hparam_defaults, "attempts_dir": ""}

    def build_model(self, hparams):
        folder = self.model_hparams(hparams)["attempts_dir"]
        if folder:
            open(os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:6]}"), "w").close()
        return super().build_model({k: v for k, v in hparams.items() if k != "attempts_dir"})

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        text = pa.concat_arrays(
            [c.flatten() for c in table.column("pixels").chunks] or [pa.array([], pa.string())]
        )
        pixels = np.asarray(text.to_numpy(zero_copy_only=False), dtype=np.float32)  # 'n/a': ValueError
        return {
            "features": torch.from_numpy(pixels).view(-1, 1, 8, 8),
            "label": torch.from_numpy(table.column("label").to_numpy().astype(np.int64)),
        }


def as_text(table: pa.Table, bad_row: int | None = None) -> pa.Table:
    """Digits rows with pixels as lists of strings; with `bad_row`, that row's first pixel 'n/a'."""
    values = [[repr(float(v)) for v in row] for row in table.column("pixels").to_pylist()]
    if bad_row is not None:
        values[bad_row][0] = "n/a"
    i = table.schema.get_field_index("pixels")
    return table.set_column(i, "pixels", pa.array(values, pa.list_(pa.string())))


class MistypedDigits(Digits):
    name = "mistyped_digits"
    column_types = {"label": "int"}  # not a kind: "integer"


class BrokenModelDigits(TextDigits):
    """A model that cannot be built (a bug, not a data error): every attempt fails."""

    name = "broken_model_digits"

    def build_model(self, hparams):
        super().build_model(hparams)  # counts the attempt
        raise RuntimeError("this model cannot be built")
