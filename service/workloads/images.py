"""Built-in workloads `images` and `images_decoded`: a small ResNet with BatchNorm on the 32x32
RGB images of `playbook data images` (service/data/images.py).

`images` reads the `png` column and decodes it in `to_batch`, online, on the loader's thread
(or its input workers), a batch of images at a time (`png.PngDecoder`): the realistic
input-bound case. `images_decoded` reads the same images already decoded (`pixels`: 3,072
uint8 values a row, channels first), which `playbook preprocess SRC DEST --workload
images_decoded` writes from the PNG data, once, offline.

Both augment the training stream, never evaluation (`augment`): a random crop of the image
padded by PAD zero pixels on each side, and a horizontal flip with probability 1/2, drawn for
each example from (the rank's data seed, the epoch, the example's id) by a counter-based hash
(`draws`). So an example's augmentation does not depend on which window, batch or worker it
lands in, and the batch of step s stays a pure function of s (resume is bitwise). The crops
and flips of a window are cut in one vectorised pass (`crop_and_flip`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from numpy.lib.stride_tricks import sliding_window_view
from torch import nn

from service.workloads.base import Workload, classification_loss, classification_metrics
from service.workloads.png import PngDecoder

SIZE, CHANNELS, PAD = 32, 3, 4
MEAN, STD = 127.5, 64.0
"""Pixel normalisation: (uint8 value - MEAN) / STD, in the model (the batch stays uint8)."""
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_DECODER = PngDecoder(SIZE, CHANNELS)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual (a 1x1 projection when the shape
    changes), as in ResNet."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A stem, `stages` stages of `blocks` BasicBlocks (width doubling and resolution halving
    from the second stage on), global average pooling and a linear head. Takes uint8 images."""

    def __init__(self, num_classes: int, width: int, blocks: int, stages: int):
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(CHANNELS, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        ]
        cin = width
        for stage in range(stages):
            cout = width * 2**stage
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if stage and not b else 1))
                cin = cout
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features((x.float() - MEAN) / STD))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def draws(seed: int, epoch: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each example's (row offset, column offset, flip) of its crop: offsets in [0, 2*PAD],
    flip 0 or 1, from a 64-bit hash of (seed, epoch, id)."""
    gamma = np.uint64(_GAMMA)
    h = _mix(np.array([seed & (2**64 - 1)], np.uint64) + gamma)
    h = _mix((h ^ np.uint64(epoch)) + gamma)
    h = _mix((h ^ ids.astype(np.uint64)) + gamma)
    span = np.uint64(2 * PAD + 1)
    return (
        (h % span).astype(np.int64),
        ((h >> np.uint64(32)) % span).astype(np.int64),
        (h >> np.uint64(63)).astype(bool),
    )


def crop_and_flip(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, flip: np.ndarray) -> np.ndarray:
    """[n, C, H, W] images: each padded by PAD zeros, cut at (dy, dx) back to H x W, then
    mirrored left-right where `flip`. Vectorised over the batch (one gather from a view of
    every image's possible crops, then one mirroring copy), exact on uint8."""
    n, c, h, w = x.shape
    padded = np.zeros((n, c, h + 2 * PAD, w + 2 * PAD), x.dtype)
    padded[:, :, PAD : PAD + h, PAD : PAD + w] = x
    crops = sliding_window_view(padded, (h, w), axis=(2, 3))  # [n, c, 2*PAD+1, 2*PAD+1, h, w]
    out = crops[np.arange(n)[:, None], np.arange(c), dy[:, None], dx[:, None]]
    out[flip] = out[flip, :, :, ::-1]
    return out


def decode_png(values: list[bytes]) -> np.ndarray:
    """PNG bytes -> [n, C, SIZE, SIZE] uint8 (`png.PngDecoder`). A value that is not a SIZE x
    SIZE RGB PNG is a ValueError (the loader names its file, column and row)."""
    return _DECODER.decode(values)


class Images(Workload):
    name = "images"
    feature_columns = ("png",)
    column_types = {"example_id": "integer", "png": "binary", "label": "integer"}
    hparam_defaults = {"width": 16, "blocks": 1, "stages": 3, "augment": True}
    augmentation = {"augment": False}
    metric_names = ("loss", "error")
    num_classes = 10
    decoded_workload = "images_decoded"

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        hp = self.model_hparams(hparams)
        return ResNet(self.num_classes, int(hp["width"]), int(hp["blocks"]), int(hp["stages"]))

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        images = decode_png(table.column("png").to_pylist())
        return {"features": torch.from_numpy(images), "label": labels_of(table)}

    def augment(self, batch, hparams, seed, epoch):
        if not self.model_hparams(hparams)["augment"]:
            return batch
        dy, dx, flip = draws(seed, epoch, batch["example_id"].numpy())
        return {**batch, "features": torch.from_numpy(crop_and_flip(batch["features"].numpy(), dy, dx, flip))}

    def loss(self, outputs, batch):
        return classification_loss(outputs, batch)

    def metrics(self, outputs, batch):
        return classification_metrics(outputs, batch)


class ImagesDecoded(Images):
    """The same task on images decoded offline: `pixels`, SIZE*SIZE*CHANNELS uint8 a row."""

    name = "images_decoded"
    feature_columns = ("pixels",)
    column_types = {"example_id": "integer", "pixels": "list<integer>", "label": "integer"}
    decoded_workload = None

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in table.column("pixels").chunks]
        pixels = np.concatenate(chunks, dtype=np.uint8) if chunks else np.empty(0, np.uint8)
        return {
            "features": torch.from_numpy(pixels).view(-1, CHANNELS, SIZE, SIZE),
            "label": labels_of(table),
        }

    def preprocess(self, table: pa.Table) -> pa.Table:
        """PNG rows (`playbook data images`) -> the decoded `pixels` column."""
        pixels = decode_png(table.column("png").to_pylist()).reshape(-1)
        column = pa.FixedSizeListArray.from_arrays(pa.array(pixels, pa.uint8()), SIZE * SIZE * CHANNELS)
        return pa.table(
            {"example_id": table.column("example_id"), "pixels": column, "label": table.column("label")}
        )


def labels_of(table: pa.Table) -> torch.Tensor:
    return torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
