"""PNG bytes -> [n, C, size, size] uint8 arrays, for the `images` workload's online decoding.

Every image is really decoded from its stored bytes: its chunks checked (CRCs), its zlib stream
inflated, its scanlines unfiltered. What is saved is Pillow's per-image Python work (opening a
file object, finding the format, parsing chunks, building an Image): the common case -- an 8-bit
RGB, non-interlaced PNG of the expected size with only IHDR, IDAT and IEND chunks -- is parsed
here, each image's stream inflated with zlib, and the scanlines of a whole batch unfiltered by
Pillow's own PNG decoder in one call, as one tall image. A blank scanline (filter type None, all
zeros) goes before each image's first: the PNG filters read that row as the one above the
first (the "prior row" PNG defines as zeros there), so every image unfilters as on its own.

Anything else (another colour type or size, interlacing, ancillary chunks, a bad CRC or zlib
stream, not a PNG at all) is decoded by Pillow's full path, image by image, with its errors:
the pixels are Pillow's either way.
"""

from __future__ import annotations

import io
import zlib

import numpy as np
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH_ROWS = 512
"""Images unfiltered in one call (bounds the tall image's memory)."""


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data)
    return len(data).to_bytes(4, "big") + kind + data + crc.to_bytes(4, "big")


class PngDecoder:
    """Decodes PNG images of `size` x `size` pixels, `channels` 3 (RGB)."""

    def __init__(self, size: int, channels: int = 3):
        if channels != 3:
            raise ValueError("only RGB images are decoded")
        self.size, self.channels = size, channels
        self.row_bytes = 1 + size * channels
        """A scanline: its filter type byte, then its pixels."""
        # Width, height, bit depth 8, colour type 2 (RGB), deflate, adaptive filters, no interlace.
        ihdr = size.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
        self.head = SIGNATURE + _chunk(b"IHDR", ihdr)
        self.tail = _chunk(b"IEND", b"")

    def decode(self, values: list) -> np.ndarray:
        """PNG bytes -> [n, C, size, size] uint8. A value Pillow cannot decode, or one that is
        not a size x size RGB image, is a ValueError."""
        out = np.empty((len(values), self.channels, self.size, self.size), np.uint8)
        for lo in range(0, len(values), BATCH_ROWS):
            part = values[lo : lo + BATCH_ROWS]
            scanlines = [self.scanlines(v) for v in part]
            fast = [i for i, s in enumerate(scanlines) if s is not None]
            if fast:
                out[lo + np.array(fast)] = self.unfilter([scanlines[i] for i in fast])
            for i in sorted(set(range(len(part))) - set(fast)):
                out[lo + i] = self.decode_with_pillow(part[i])
        return out

    def scanlines(self, value) -> bytes | None:
        """The inflated, still filtered scanlines of a PNG in the common case (see the module
        docstring), or None for anything else."""
        if not isinstance(value, bytes) or not value.startswith(self.head) or not value.endswith(self.tail):
            return None
        view, pos, end, idat = memoryview(value), len(self.head), len(value) - len(self.tail), []
        while pos < end:
            length = int.from_bytes(view[pos : pos + 4], "big")
            stop = pos + 8 + length
            if stop + 4 > end or view[pos + 4 : pos + 8] != b"IDAT":
                return None
            if zlib.crc32(view[pos + 4 : stop]) != int.from_bytes(view[stop : stop + 4], "big"):
                return None
            idat.append(view[pos + 8 : stop])
            pos = stop + 4
        inflate = zlib.decompressobj()
        try:  # at most one byte past the image: a stream that inflates to more goes to Pillow
            raw = inflate.decompress(b"".join(idat), self.size * self.row_bytes + 1)
        except zlib.error:
            return None
        if not inflate.eof or inflate.unused_data:
            return None  # cut short, longer than the image, or bytes after the stream
        if len(raw) != self.size * self.row_bytes or max(raw[:: self.row_bytes]) > 4:
            return None  # short or long, or a filter type PNG does not define
        return raw

    def unfilter(self, scanlines: list[bytes]) -> np.ndarray:
        """Images' filtered scanlines -> [n, C, size, size], by Pillow's PNG decoder, in one
        call: the images stacked into one tall image, a blank scanline before each."""
        n, side = len(scanlines), self.size
        blank = bytes(self.row_bytes)
        stream = zlib.compress(blank + blank.join(scanlines), 0)  # stored: no compression work
        tall = Image.frombytes("RGB", (side, (side + 1) * n), stream, "zip", "RGB")
        return np.asarray(tall).reshape(n, side + 1, side, self.channels)[:, 1:].transpose(0, 3, 1, 2)

    def decode_with_pillow(self, value) -> np.ndarray:
        """One image through Pillow's full path: [C, size, size]."""
        try:
            image = Image.open(io.BytesIO(value))
            image.load()
        except (OSError, TypeError) as e:
            raise ValueError(f"not a PNG image ({e})") from None
        if image.size != (self.size, self.size) or image.mode != "RGB":
            raise ValueError(
                f"an image of {image.size[0]}x{image.size[1]} {image.mode}, not {self.size}x{self.size} RGB"
            )
        return np.asarray(image).transpose(2, 0, 1)
