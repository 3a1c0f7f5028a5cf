"""Test workloads for the input-pipeline diagnosis (loaded as `tests.helpers.input_workloads:Class`)."""

from __future__ import annotations

import time

from service.workloads.digits import Digits

SLOW_S_PER_ROW = 0.001


class SlowDigits(Digits):
    """Digits whose online preprocessing costs 1 ms per example (a decode/augment stand-in)."""

    name = "slow_digits"

    def to_batch(self, table):
        time.sleep(SLOW_S_PER_ROW * table.num_rows)
        return super().to_batch(table)


class JunkDigits(Digits):
    """Digits that declares a column it never uses."""

    name = "junk_digits"
    feature_columns = ("pixels", "junk")


class RawDigits(Digits):
    """Digits whose raw files hold 0..16 integer pixels (`raw`); preprocessing scales them to
    [0, 1] float32 `pixels` once, offline."""

    name = "raw_digits"

    def preprocess(self, table):
        import numpy as np
        import pyarrow as pa

        raw = table.column("raw").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        pixels = pa.FixedSizeListArray.from_arrays(pa.array((raw / 16.0).astype(np.float32)), 64)
        return table.append_column("pixels", pixels)
