"""The `images` workload's batch work against image-by-image references written here: the
vectorised crop + flip against a plain numpy loop (and wrong implementations caught by the same
comparison), and the batch PNG decoder against Pillow's own decoding, on hand-built PNGs that use
every PNG filter type (first rows included, whose filters read the zero row above the image),
on the generated data set, and on files it must hand to Pillow whole."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, PngImagePlugin

from service.data.images import write_images
from service.workloads import images
from service.workloads.png import PngDecoder

SIZE, PAD = 32, 4


def loop_crop_and_flip(x: np.ndarray, dy, dx, flip) -> np.ndarray:
    """One image at a time: np.pad by PAD zeros, slice, mirror the columns."""
    out = np.empty_like(x)
    for i in range(len(x)):
        padded = np.pad(x[i], ((0, 0), (PAD, PAD), (PAD, PAD)))
        crop = padded[:, dy[i] : dy[i] + SIZE, dx[i] : dx[i] + SIZE]
        out[i] = crop[:, :, ::-1] if flip[i] else crop
    return out


def agrees_with_the_loop(crop_and_flip) -> bool:
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, (300, 3, SIZE, SIZE), dtype=np.uint8)
    dy, dx, flip = images.draws(12345, 3, rng.permutation(10_000)[:300])
    assert len(set(zip(dy.tolist(), dx.tolist(), flip.tolist(), strict=True))) > 120  # most cases drawn
    return np.array_equal(crop_and_flip(x.copy(), dy, dx, flip), loop_crop_and_flip(x, dy, dx, flip))


def test_batch_crop_and_flip_equals_a_per_image_loop():
    assert agrees_with_the_loop(images.crop_and_flip)


@pytest.mark.parametrize(
    "wrong",
    [
        lambda x, dy, dx, flip: images.crop_and_flip(x, dx, dy, flip),  # offsets swapped
        lambda x, dy, dx, flip: images.crop_and_flip(x, dy, dx, ~flip),  # the other half mirrored
        lambda x, dy, dx, flip: images.crop_and_flip(x, dy, dx, np.zeros_like(flip)),  # never mirrored
        lambda x, dy, dx, flip: images.crop_and_flip(x, 2 * PAD - dy, dx, flip),  # rows mirrored offset
        lambda x, dy, dx, flip: images.crop_and_flip(x.transpose(0, 1, 3, 2), dy, dx, flip),  # W, H swapped
    ],
)
def test_the_loop_comparison_catches_a_wrong_crop(wrong):
    assert not agrees_with_the_loop(wrong)


def test_the_workload_augments_a_batch_as_the_loop_does():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 3, SIZE, SIZE), dtype=np.uint8)
    ids = rng.permutation(1000)[:40]
    batch = {"features": torch.from_numpy(x), "example_id": torch.from_numpy(ids), "label": torch.zeros(40)}
    got = images.Images().augment(batch, {}, seed=99, epoch=2)["features"]
    np.testing.assert_array_equal(got.numpy(), loop_crop_and_flip(x, *images.draws(99, 2, ids)))


def chunk(kind: bytes, data: bytes, crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + data) if crc is None else crc
    return len(data).to_bytes(4, "big") + kind + data + crc.to_bytes(4, "big")


def hand_png(rng: np.random.Generator, first_filter: int, idat_parts: int = 1, size: int = SIZE) -> bytes:
    """An 8-bit RGB PNG written here: random filtered scanlines (any bytes are a valid filtered
    stream), the first row's filter type given, the others random, in `idat_parts` IDAT chunks."""
    rows = rng.integers(0, 256, (size, 1 + 3 * size), dtype=np.uint8)
    rows[:, 0] = rng.integers(0, 5, size)
    rows[0, 0] = first_filter
    stream = zlib.compress(rows.tobytes(), 6)
    ihdr = size.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    cuts = np.linspace(0, len(stream), idat_parts + 1).astype(int)
    idats = b"".join(chunk(b"IDAT", stream[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idats + chunk(b"IEND", b"")


def pillow(value: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(value)).convert("RGB")).transpose(2, 0, 1)


class Counting(PngDecoder):
    """The decoder, counting the images it hands to Pillow's full path."""

    def __init__(self):
        super().__init__(SIZE)
        self.whole = 0

    def decode_with_pillow(self, value):
        self.whole += 1
        return super().decode_with_pillow(value)


def test_every_filter_type_decodes_as_pillow_does_in_one_batch_call():
    rng = np.random.default_rng(3)
    values = [hand_png(rng, first_filter=i % 5, idat_parts=1 + i % 3) for i in range(30)]
    decoder = Counting()
    got = decoder.decode(values)
    assert decoder.whole == 0  # all of them unfiltered together
    np.testing.assert_array_equal(got, np.stack([pillow(v) for v in values]))


def test_the_generated_images_decode_as_pillow_does(tmp_path):
    write_images(str(tmp_path), 40, seed=5)
    values = pq.read_table(tmp_path / "train", columns=["png"]).column("png").to_pylist()
    decoder = Counting()
    got = decoder.decode(values)
    assert decoder.whole == 0
    np.testing.assert_array_equal(got, np.stack([pillow(v) for v in values]))
    np.testing.assert_array_equal(images.decode_png(values), got)


def pil_png(array: np.ndarray, mode: str = "RGB", **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode=mode).save(buf, format="PNG", **save)
    return buf.getvalue()


def test_other_pngs_go_to_pillow_with_the_same_pixels_and_errors():
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    text = PngImagePlugin.PngInfo()
    text.add_text("note", "an ancillary chunk")
    good = hand_png(rng, 4)
    end = good.index(b"IEND") - 4
    bad_crc = good[: end - 4] + bytes(4) + good[end:]  # the last IDAT's CRC zeroed
    others = [pil_png(pixels, pnginfo=text), bad_crc, good + b"trailing bytes"]
    decoder = Counting()
    got = decoder.decode([good, *others, good])
    assert decoder.whole == len(others)
    np.testing.assert_array_equal(got, np.stack([pillow(v) for v in [good, *others, good]]))
    rgba = pil_png(rng.integers(0, 256, (SIZE, SIZE, 4), dtype=np.uint8), "RGBA")
    with pytest.raises(ValueError, match="an image of 32x32 RGBA, not 32x32 RGB"):
        decoder.decode([good, rgba])
    with pytest.raises(ValueError, match="an image of 16x16 RGB, not 32x32 RGB"):
        decoder.decode([hand_png(rng, 0, size=16)])
    with pytest.raises(ValueError, match="not a PNG image"):
        decoder.decode([good, good[:-30]])  # truncated


def test_a_stream_that_inflates_past_the_image_is_not_inflated_whole():
    """A PNG whose IDAT stream inflates to far more than a SIZE x SIZE image (a decompression
    bomb, or garbage after the scanlines) leaves the fast path after one byte too many: it is
    never held inflated in memory (Pillow's full path, with its own limits, decides)."""
    import tracemalloc

    ihdr = SIZE.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    stream = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zero bytes: valid filter type 0 rows
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")
    tracemalloc.start()
    try:
        assert PngDecoder(SIZE).scanlines(bomb) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
