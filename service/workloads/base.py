"""The Workload interface: what a study trains, and on which columns (the contract, with a
complete example, is docs/workloads.md).

A workload owns the model, the loss and the per-example metrics, and names the parquet columns
it reads (the loader projects exactly those at read time). It is plain PyTorch.
"""

from __future__ import annotations

import abc
from typing import Any

import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn


class Workload(abc.ABC):
    name: str = ""
    id_column: str = "example_id"
    """Integer column naming each example (unique within a split). The loader reads it itself
    and adds it to every batch as `example_id`: `to_batch` need not return it."""
    label_column: str = "label"
    feature_columns: tuple[str, ...] = ()
    column_types: dict[str, str] = {}
    """The type each column must have in every data file, by kind: "integer", "floating",
    "numeric" (either), "boolean", "string", "binary", or "list<KIND>" (a list or fixed-size
    list of it). `playbook validate --data` and the loader check it from the files' footers
    alone (`data.files.check_column_types`); a column not named here is only checked to have
    the same type in every file."""
    metric_names: tuple[str, ...] = ("loss",)
    """Names of the per-example metrics `metrics()` returns (reported as validation/<name>)."""
    hparam_defaults: dict[str, Any] = {}
    """Model hyperparameters this workload accepts, with their defaults."""
    regularizers: dict[str, Any] = {}
    """Hyperparameters of `hparam_defaults` that regularise (dropout, label smoothing, ...),
    each with the value that switches it off. `playbook find-steps` sweeps with all of them off
    (and weight_decay 0), as the playbook's max_train_steps finder asks."""
    augmentation: dict[str, Any] = {}
    """Hyperparameters of `hparam_defaults` that switch data augmentation, each with its 'off'
    value (e.g. {"augment": False}); `playbook find-steps` sweeps with augmentation off."""
    num_classes: int | None = None
    """A classifier's number of classes: its outputs must then be [batch, num_classes] logits,
    and evaluations add per-class support / precision / recall and the predictions file's
    `prediction` (argmax) and `score` (its softmax probability). None: outputs of any shape,
    kept as the predictions file's `output` column; no per-class metrics."""
    outputs_in_predictions: bool = True
    """False: a non-classifier's predictions file has no `output` column (outputs too large to
    keep per example, e.g. a language model's per-token logits); its per-example metrics and
    weights are kept as always."""

    decoded_workload: str | None = None
    """For a workload whose `to_batch` decodes (images, audio, ...): the workload that reads the
    same data decoded, as its `preprocess` writes it (`playbook preprocess SRC DEST --workload
    <it>`). The input-bound verdict names it when decoding is what the steps wait for."""

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.id_column, *self.feature_columns, self.label_column)

    @abc.abstractmethod
    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        """The model, built from the merged hyperparameters (defaults + trial values)."""

    @abc.abstractmethod
    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        """Columns -> tensors, vectorised (no per-example Python loop), one row per table row.
        Must include 'label'; `forward` reads the rest (by default 'features')."""

    @abc.abstractmethod
    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-example training loss, shape [batch]."""

    @abc.abstractmethod
    def metrics(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-example evaluation metrics, each shape [batch]; averaged over real examples."""

    def preprocess(self, table: pa.Table) -> pa.Table:
        """Offline preprocessing (`playbook preprocess`), once per row group of the raw data:
        raw columns -> the declared `columns`, vectorised. Default: the columns as they are."""
        return table.select(list(self.columns))

    def augment(
        self, batch: dict[str, torch.Tensor], hparams: dict[str, Any], seed: int, epoch: int
    ) -> dict[str, torch.Tensor]:
        """Online data augmentation of the training stream only (never evaluation): a window's
        batch from `to_batch` (with its `example_id`) -> the batch augmented, vectorised, on
        the loader's thread or its input workers. `hparams` are the trial's; draw each example's
        randomness from (seed, epoch, its example_id) -- `seed` is the rank's data seed -- so
        that the batch of step s stays a pure function of s. Default: the batch as it is."""
        return batch

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["features"])

    def loss_weight(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """What the training loss of `batch` is a mean over, when it is not its rows (e.g. a
        language model's real tokens), as a device scalar. With microbatches each one's mean
        loss counts in proportion to it, so the step's loss stays the mean over the whole
        per-worker batch. Default None: the rows, equal for equal microbatches."""
        return None

    def model_hparams(self, hparams: dict[str, Any]) -> dict[str, Any]:
        return {**self.hparam_defaults, **{k: v for k, v in hparams.items() if k in self.hparam_defaults}}

    def param_groups(self, model: nn.Module, hparams: dict[str, Any]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: torch's `[{"params": [...], option: value, ...}]`,
        every trainable parameter in exactly one group. The service builds the study's optimizer
        over them with the trial's hyperparameters; a group's own option (e.g. `weight_decay: 0.0`)
        overrides that hyperparameter for its parameters; `lr` is the schedule's. Default: one
        group of every parameter (`no_weight_decay_groups` keeps norms and biases from decay)."""
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """With `scaling.strategy: fsdp`: the model's sharding units, each gathered whole for its
        own forward and backward and freed after (FSDP2's `fully_shard`, applied by the service to
        each unit, then to the model for the parameters of no unit). Units must not share a
        parameter with anything outside them. Typically a transformer's blocks; peak memory is
        about the largest unit's full parameters plus every unit's shard. Default: one unit
        per top-level child (`top_level_units`)."""
        return top_level_units(model)

    def optimizer(
        self, param_groups: list[dict[str, Any]], hparams: dict[str, Any]
    ) -> torch.optim.Optimizer | None:
        """With `training.optimizer: workload`: this workload's own optimizer over
        `param_groups` (its `param_groups`, fresh dicts), from the trial's hyperparameters. It
        must read each of weight_decay, momentum, beta1, beta2 and eps that the trial sets (the
        service rebuilds it with each one changed and refuses it when nothing changes); the
        schedule sets every group's `lr` at each step. Default: None (none of its own)."""
        return None


def top_level_units(model: nn.Module) -> list[nn.Module]:
    """The model's top-level children that hold parameters, a ModuleList's or ModuleDict's
    children in its place (a container without a forward of its own is never called, so it
    cannot gather anything). A child sharing a parameter with another one (tied weights) is
    left to the root unit."""
    children = []
    for child in model.children():
        inner = child.children() if isinstance(child, nn.ModuleList | nn.ModuleDict) else [child]
        children += [m for m in inner if any(True for _ in m.parameters())]
    owners: dict[int, int] = {}
    for m in children:
        for p in m.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in children if all(owners[id(p)] == 1 for p in m.parameters())]


def no_weight_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups: weights of two or more dimensions (decayed) and the rest, the
    biases and the norm layers' scales and shifts, with `weight_decay: 0.0`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def classification_loss(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy of [batch, classes] logits against `label`."""
    return F.cross_entropy(outputs, batch["label"], reduction="none")


def classification_metrics(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-example `loss` (cross-entropy) and `error` (argmax is not the label)."""
    return {
        "loss": classification_loss(outputs, batch),
        "error": (outputs.argmax(dim=1) != batch["label"]).float(),
    }
