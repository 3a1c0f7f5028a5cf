"""`playbook data images URI`: 32x32 RGB digit images made locally, stored as PNG bytes in
parquet (the `images` workload's data; no download).

Each image is one of scikit-learn's 8x8 handwritten digits, upscaled to a random size, placed
at a random position, coloured against a procedurally textured background (smooth noise,
stripes at a random angle and frequency, or a linear gradient, plus pixel noise), then
colour-jittered (brightness and contrast). The label is the digit. The source digits are split
between train / validation / test first, so no handwritten digit appears in two splits (the
splits differ by writer's stroke, not only by placement and colour). Everything is drawn from
`seed`: the same count and seed give the same bytes.

Columns: `example_id` (unique over all splits), `png` (the encoded image), `label` (the digit)
and `source_digit` (the index of the source image in `sklearn.datasets.load_digits`).
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from service.core import storage
from service.core.errors import DataError

SIZE = 32
SPLITS = {"train": 0.8, "validation": 0.1, "test": 0.1}
"""Each split's share of the source digits and of the images."""
FILES_PER_SPLIT = {"train": 8, "validation": 2, "test": 2}
ROW_GROUP_SIZE = 512
DEFAULT_COUNT = 50_000
MIN_COUNT = 30
GLYPH_SIZES = (14, 28)
"""The side of the upscaled digit, in pixels (inclusive range)."""


def source_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ([n, 8, 8] floats in [0, 1], [n] labels)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int64)


def split_sources(num_sources: int, seed: int) -> dict[str, np.ndarray]:
    """The indices of the source digits of each split: disjoint, drawn with `seed`."""
    order = np.random.default_rng([seed, 0]).permutation(num_sources)
    bounds = np.cumsum([0] + [round(share * num_sources) for share in SPLITS.values()])
    bounds[-1] = num_sources
    return {s: np.sort(order[bounds[i] : bounds[i + 1]]) for i, s in enumerate(SPLITS)}


def split_counts(count: int) -> dict[str, int]:
    """Images per split: `count` shared as SPLITS says (the train split takes the rounding)."""
    out = {s: round(share * count) for s, share in SPLITS.items() if s != "train"}
    return {"train": count - sum(out.values()), **out}


def _smooth_noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, SIZE, SIZE] in [0, 1]: a 5x5 random grid, bilinearly interpolated."""
    grid = rng.random((n, 5, 5))
    pos = np.linspace(0, 4, SIZE)
    i0 = np.minimum(pos.astype(int), 3)
    w = pos - i0
    rows = grid[:, i0, :] * (1 - w)[None, :, None] + grid[:, i0 + 1, :] * w[None, :, None]
    return rows[:, :, i0] * (1 - w) + rows[:, :, i0 + 1] * w


def backgrounds(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, SIZE, SIZE, 3] floats in [0, 255]: per image a texture (smooth noise, stripes or a
    gradient) between two random colours, plus pixel noise."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / (SIZE - 1)
    angle = rng.uniform(0, np.pi, (n, 1, 1))
    along = xx * np.cos(angle) + yy * np.sin(angle)
    frequency, phase = rng.uniform(1.5, 6.0, (n, 1, 1)), rng.uniform(0, 2 * np.pi, (n, 1, 1))
    stripes = 0.5 + 0.5 * np.sin(2 * np.pi * frequency * along + phase)
    gradient = (along - along.min(axis=(1, 2), keepdims=True)) / np.ptp(along, axis=(1, 2), keepdims=True)
    kind = rng.integers(0, 3, n)[:, None, None]
    t = np.where(kind == 0, _smooth_noise(rng, n), np.where(kind == 1, stripes, gradient))
    c0, c1 = rng.uniform(0, 255, (2, n, 1, 1, 3))
    return c0 + t[..., None] * (c1 - c0) + rng.normal(0, 6, (n, SIZE, SIZE, 3))


def glyph_masks(rng: np.random.Generator, glyphs: np.ndarray) -> np.ndarray:
    """[n, SIZE, SIZE] coverage in [0, 1]: each 8x8 glyph upscaled (bilinear) to a random size
    and placed at a random position."""
    masks = np.zeros((len(glyphs), SIZE, SIZE), np.float32)
    sizes = rng.integers(GLYPH_SIZES[0], GLYPH_SIZES[1] + 1, len(glyphs))
    for i, (glyph, side) in enumerate(zip(glyphs, sizes, strict=True)):
        y, x = rng.integers(0, SIZE - side + 1, 2)
        scaled = Image.fromarray(glyph, mode="F").resize((int(side), int(side)), Image.Resampling.BILINEAR)
        masks[i, y : y + side, x : x + side] = np.clip(np.asarray(scaled), 0.0, 1.0)
    return masks


def compose(rng: np.random.Generator, glyphs: np.ndarray) -> np.ndarray:
    """[n, SIZE, SIZE, 3] uint8 images: the glyphs in a colour contrasting with their
    background (dark on light, light on dark), then brightness and contrast jitter."""
    n = len(glyphs)
    background = backgrounds(rng, n)
    light = background.mean(axis=(1, 2, 3)) > 127.5
    dark_ink, light_ink = rng.uniform(0, 90, (n, 3)), rng.uniform(165, 255, (n, 3))
    ink = np.where(light[:, None], dark_ink, light_ink)[:, None, None, :]
    alpha = glyph_masks(rng, glyphs)[..., None]
    image = background * (1 - alpha) + ink * alpha
    mean = image.mean(axis=(1, 2, 3), keepdims=True)
    contrast, brightness = rng.uniform(0.75, 1.25, (2, n, 1, 1, 1))
    return np.clip((image - mean) * contrast + mean * brightness, 0, 255).round().astype(np.uint8)


def encode_png(images: np.ndarray) -> list[bytes]:
    """Each [SIZE, SIZE, 3] uint8 image as PNG bytes."""
    out = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image, mode="RGB").save(buf, format="PNG", compress_level=1)
        out.append(buf.getvalue())
    return out


def image_table(rng: np.random.Generator, ids: np.ndarray, pool: np.ndarray, sources) -> pa.Table:
    """Rows `ids`: images of source digits drawn from `pool` (indices into `sources`)."""
    glyphs, labels = sources
    chosen = rng.choice(pool, len(ids))
    return pa.table(
        {
            "example_id": pa.array(ids, pa.int64()),
            "png": pa.array(encode_png(compose(rng, glyphs[chosen])), pa.binary()),
            "label": pa.array(labels[chosen], pa.int64()),
            "source_digit": pa.array(chosen, pa.int64()),
        }
    )


def write_images(uri: str, count: int = DEFAULT_COUNT, seed: int = 0) -> dict[str, list[str]]:
    """`count` images over train / validation / test, several parquet files per split, each
    file drawn from its own generator seeded by (seed, split, file). Returns the written file
    URIs by split."""
    if count < MIN_COUNT:
        raise DataError(f"--count: at least {MIN_COUNT} images (got {count})")
    sources = source_digits()
    pools = split_sources(len(sources[1]), seed)
    written: dict[str, list[str]] = {}
    first_id = 0
    for s, (split, n) in enumerate(split_counts(count).items()):
        ids = np.arange(first_id, first_id + n)
        first_id += n
        written[split] = []
        for j, part in enumerate(np.array_split(ids, min(FILES_PER_SPLIT[split], n))):
            table = image_table(np.random.default_rng([seed, s + 1, j]), part, pools[split], sources)
            buf = io.BytesIO()
            pq.write_table(table, buf, row_group_size=ROW_GROUP_SIZE)
            file_uri = storage.join(uri, split, f"part-{j:05d}.parquet")
            storage.write_bytes_atomic(file_uri, buf.getvalue())
            written[split].append(file_uri)
    return written
