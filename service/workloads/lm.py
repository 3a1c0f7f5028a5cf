"""Built-in workload `lm`: a decoder-only transformer language model (nanoGPT-sized) over the
byte-level corpus of `playbook data text` (service/data/text.py).

A row is one sequence: `bytes` (its target bytes, zero-padded), `context` (the token before
them) and `num_tokens` (its real positions, the label). The model reads `context` + all bytes but
the last and predicts every byte; padded positions have weight 0 everywhere:

- the training loss is the mean cross-entropy over the real tokens of the worker's batch;
- `metrics` are per sequence (the mean over its real tokens) and `to_batch` gives each sequence
  the weight `num_tokens`, so the evaluation's weighted sums are sums over real tokens: the
  reported `validation/loss` is sum(token losses) / sum(real tokens) over the whole split, and
  `validation/bits_per_byte` is that in bits (one token is one byte);
- predictions are per sequence (`metric/loss`, `weight` = its token count), never per token.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from service.core.errors import SpecError
from service.workloads.base import Workload

VOCAB = 257
"""The 256 byte values and the token before a file's first byte (service.data.text.BOS)."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token and position embeddings, `depth` blocks, a final LayerNorm and the vocabulary head
    (its weight tied to the token embedding when `tie_embeddings`)."""

    def __init__(self, depth: int, width: int, heads: int, context: int, dropout: float, tie: bool):
        super().__init__()
        if width % heads:
            raise SpecError(f"workload lm: width {width} is not a multiple of heads {heads}")
        self.context = context
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        if tie:
            self.head.weight = self.tokens.weight
        self.apply(_init)
        for b in self.blocks:  # nanoGPT: residual projections scaled down with depth
            nn.init.normal_(b.proj.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:  # deterministic: a bad study, not a failure to retry
            raise SpecError(
                f"workload lm: context {self.context} is shorter than the data's sequences ({t} tokens); "
                "set the hyperparameter context to at least the data's --seq-len"
            )
        x = self.drop(self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class LanguageModel(Workload):
    name = "lm"
    label_column = "num_tokens"
    feature_columns = ("bytes", "context")
    column_types = {"example_id": "integer", "bytes": "binary", "context": "integer", "num_tokens": "integer"}
    metric_names = ("loss", "bits_per_byte")
    hparam_defaults = {
        "depth": 2,
        "width": 64,
        "heads": 4,
        "context": 256,
        "dropout": 0.0,
        "tie_embeddings": True,
    }
    regularizers = {"dropout": 0.0}
    outputs_in_predictions = False  # logits are [positions, vocabulary] per sequence

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        hp = self.model_hparams(hparams)
        return GPT(
            int(hp["depth"]),
            int(hp["width"]),
            int(hp["heads"]),
            int(hp["context"]),
            float(hp["dropout"]),
            bool(hp["tie_embeddings"]),
        )

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Under fsdp, each transformer block is a unit; the embeddings, the final norm and
        the head (tied to the token embedding) are the root's."""
        return list(model.blocks)

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        """`tokens` [rows, seq_len + 1] (context, then the target bytes), `label` and `weight`
        the number of real targets."""
        targets = fixed_size_bytes(table.column("bytes"))
        tokens = np.empty((len(targets), targets.shape[1] + 1), dtype=np.int64)
        tokens[:, 0] = table.column("context").to_numpy()
        tokens[:, 1:] = targets
        num_tokens = table.column(self.label_column).to_numpy().astype(np.int64)
        return {
            "tokens": torch.from_numpy(tokens),
            "label": torch.from_numpy(num_tokens),
            "weight": torch.from_numpy(num_tokens.astype(np.float32)),
        }

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["tokens"][:, :-1])

    def loss(self, outputs, batch):
        """Per sequence: its summed token loss x rows / the batch's real tokens, so that the
        mean over the batch (the step's loss) is the mean over its real tokens."""
        summed = token_losses(outputs, batch).sum(dim=1)
        return summed * (len(summed) / batch["label"].sum().clamp(min=1))

    def loss_weight(self, batch):
        """The loss is a mean over real tokens: a microbatch counts by its real tokens."""
        return batch["label"].sum()

    def metrics(self, outputs, batch):
        """Per sequence, the mean over its real tokens in float64 (times its weight, the token
        count, this is the summed token loss)."""
        mean = token_losses(outputs, batch).double().sum(dim=1) / batch["label"].clamp(min=1)
        return {"loss": mean, "bits_per_byte": mean / math.log(2)}


def token_losses(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of every position [rows, seq_len] in float32, 0 at padded positions."""
    targets = batch["tokens"][:, 1:]
    n, t = targets.shape
    losses = F.cross_entropy(outputs.reshape(n * t, -1).float(), targets.reshape(-1), reduction="none")
    real = torch.arange(t, device=targets.device) < batch["label"][:, None]
    return torch.where(real, losses.view(n, t), 0.0)


def fixed_size_bytes(column: pa.ChunkedArray) -> np.ndarray:
    """A fixed_size_binary(L) column as a [rows, L] uint8 array, one copy from its chunks."""
    if not pa.types.is_fixed_size_binary(column.type) or column.null_count:
        what = f"{column.null_count} null(s)" if column.null_count else f"type {column.type}"
        raise ValueError(f"column 'bytes' must be fixed_size_binary without nulls, has {what}")
    width = column.type.byte_width
    parts = [
        np.frombuffer(c.buffers()[1], np.uint8)[c.offset * width : (c.offset + len(c)) * width]
        for c in column.chunks
    ]
    return np.concatenate([np.zeros(0, np.uint8), *parts]).reshape(-1, width)
