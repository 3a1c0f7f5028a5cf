"""The `lm` workload's evaluation over 2 gloo ranks with shards of different sizes, so different
padding (a fifth of the rows on rank 0, the rest on rank 1; sequences of different lengths on
each): every rank's reduced loss is the single-process sum of token losses / real tokens."""

from __future__ import annotations

import math

import pytest
import torch

from service import workloads
from service.data import text
from service.data.files import list_files
from service.data.loader import eval_batches
from service.data.sharding import row_ranges
from service.evaluation.run import evaluate
from tests.helpers.gloo import run_gloo
from tests.helpers.lm_reference import corpus_rows, plain_token_losses

SEQ_LEN, EVAL_BATCH = 20, 6
HPARAMS = {"depth": 1, "width": 16, "heads": 2, "context": SEQ_LEN}


def model():
    torch.manual_seed(0)
    return workloads.get("lm").build_model(HPARAMS)


def eval_rank(rank, world, data_dir):
    workload, files = workloads.get("lm"), list_files(f"{data_dir}/validation")
    parts = [0] if rank == 0 else [1, 2, 3, 4]
    ranges = [r for p in parts for r in row_ranges(files, p, 5)]
    batches = eval_batches(workload, ranges, EVAL_BATCH)
    rows = sum(r.stop - r.start for r in ranges)
    return {"result": evaluate(model(), workload, batches, EVAL_BATCH, "cpu"), "rows": rows}


def test_two_ranks_with_different_padding_reduce_to_the_single_process_sum(tmp_path):
    data_dir = tmp_path / "text"
    text.write_text(str(data_dir), 10_000, SEQ_LEN)
    results = run_gloo(eval_rank, 2, tmp_path, str(data_dir))
    rows = corpus_rows(str(data_dir / "validation"))
    total, count = plain_token_losses(model(), rows)
    shard_rows = [r["rows"] for r in results]
    assert sum(shard_rows) == len(rows) and len({n % EVAL_BATCH for n in shard_rows}) == 2
    for r in results:
        assert r["result"]["count"] == len(rows)
        assert r["result"]["loss"] == pytest.approx(total / count, rel=1e-6)
        assert r["result"]["bits_per_byte"] == pytest.approx(total / count / math.log(2), rel=1e-6)
