"""The `lm` workload (service/workloads/lm.py) against plain loops over the corpus rows: the
training loss is the mean over real tokens, evaluation is exact per token over padded batches,
predictions are per sequence; the model is causal and its embeddings tied when asked."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from service import workloads
from service.core.errors import SpecError
from service.data import text
from service.data.files import list_files
from service.data.loader import eval_batches
from service.data.sharding import row_ranges
from service.evaluation.predictions import PredictionLog
from service.evaluation.run import evaluate
from tests.helpers.lm_reference import plain_token_losses

SEQ_LEN = 24
HPARAMS = {"depth": 2, "width": 32, "heads": 4, "context": SEQ_LEN}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    text.write_text(str(root), 12_000, SEQ_LEN)
    return root


def model_of(seed: int = 0, **hparams):
    torch.manual_seed(seed)
    return workloads.get("lm").build_model({**HPARAMS, **hparams}).eval()


def shortest_first(rows: list[dict], k: int) -> list[dict]:
    """k rows, the file-ending (short) ones first, so padded positions are in the batch."""
    return sorted(rows, key=lambda r: r["num_tokens"])[:k]


def test_the_training_loss_is_the_mean_over_the_real_tokens(corpus):
    workload, model = workloads.get("lm"), model_of()
    table = pq.read_table(str(corpus / "train"))
    rows = shortest_first(table.to_pylist(), 12)
    assert rows[0]["num_tokens"] < SEQ_LEN
    batch = workload.to_batch(table.take([r["example_id"] for r in rows]))
    with torch.no_grad():
        loss = workload.loss(workload.forward(model, batch), batch).mean().item()
    total, count = plain_token_losses(model, rows)
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_evaluation_sums_token_losses_over_padded_batches(corpus):
    """validation/loss = sum of token losses / real tokens over the split, in eval batches of 7
    or 8 (the last padded with zero-weight rows); bits_per_byte the same in bits; one prediction row
    per sequence with its loss and token count, no per-token outputs."""
    workload, model = workloads.get("lm"), model_of()
    rows = pq.read_table(str(corpus / "validation")).to_pylist()
    size = 7 if len(rows) % 7 else 8
    files = list_files(str(corpus / "validation"))
    log = PredictionLog.of(workload)
    result = evaluate(
        model, workload, eval_batches(workload, row_ranges(files, 0, 1), size), size, "cpu", log
    )
    total, count = plain_token_losses(model, rows)
    assert len(rows) % size and result["count"] == len(rows)
    assert result["loss"] == pytest.approx(total / count, rel=1e-6)
    assert result["bits_per_byte"] == pytest.approx(total / count / math.log(2), rel=1e-6)
    kept = log.gather()
    assert "output" not in kept
    np.testing.assert_array_equal(kept["example_id"], [r["example_id"] for r in rows])
    np.testing.assert_array_equal(kept["weight"], [r["num_tokens"] for r in rows])
    assert float(np.sum(kept["metric/loss"] * kept["weight"])) == pytest.approx(total, rel=1e-6)


def test_the_model_is_causal():
    model = model_of()
    tokens = torch.randint(0, 257, (2, SEQ_LEN))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 257
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_tied_embeddings_share_one_matrix():
    tied, untied = model_of(tie_embeddings=True), model_of(tie_embeddings=False)
    assert tied.head.weight is tied.tokens.weight
    assert untied.head.weight is not untied.tokens.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 257 * HPARAMS["width"]


def test_sequences_longer_than_the_context_are_refused():
    with pytest.raises(
        SpecError, match=r"^workload lm: context 24 is shorter than the data's sequences \(25 tokens\)"
    ):
        model_of()(torch.zeros(1, SEQ_LEN + 1, dtype=torch.int64))


def test_to_batch_builds_the_tokens_by_hand(corpus):
    table = pq.read_table(str(corpus / "validation")).slice(0, 3)
    batch = workloads.get("lm").to_batch(table)
    for i, r in enumerate(table.to_pylist()):
        assert batch["tokens"][i].tolist() == [r["context"], *r["bytes"]]
        assert batch["label"][i] == batch["weight"][i] == r["num_tokens"]


def test_microbatches_count_by_their_real_tokens(corpus):
    """With microbatches of different real-token counts (two short file-ending sequences, then two
    full ones), the step's gradients are those of one mean over the batch's real tokens, by hand.
    Dividing each microbatch's mean by their number instead gives other gradients."""
    from types import SimpleNamespace

    from service.trainer.precision import Precision
    from service.trainer.step import forward_backward

    workload, table = workloads.get("lm"), pq.read_table(str(corpus / "train"))
    rows = (
        shortest_first(table.to_pylist(), 2)
        + [r for r in table.to_pylist() if r["num_tokens"] == SEQ_LEN][:2]
    )
    batch = workload.to_batch(table.take([r["example_id"] for r in rows]))
    model = model_of().train()
    ctx = SimpleNamespace(
        workload=workload, trained=model, precision=Precision("fp32", "cpu"), microbatch_size=2
    )
    loss = forward_backward(ctx, batch)
    stepped = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for r in rows:  # the plain loop: every sequence alone, its real tokens only
        real = list(r["bytes"][: r["num_tokens"]])
        logits = model(torch.tensor([[r["context"], *real[:-1]]]))[0]
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(real), reduction="sum")
        count += len(real)
    (total / count).backward()
    assert loss.item() == pytest.approx(total.item() / count, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(stepped[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
