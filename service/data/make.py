"""`playbook data KIND URI [--count N] [--seed S]`: the built-in data sets, made locally (no
download). One entry per kind in DATASETS: a builder called as `builder(uri, count, seed)`
(count None: the kind's default size) that returns the written file URIs by split."""

from __future__ import annotations

from collections.abc import Callable

from service.core.errors import DataError
from service.data import text

Builder = Callable[[str, "int | None", int], dict[str, list[str]]]


def digits(uri: str, count: int | None, seed: int) -> dict[str, list[str]]:
    """scikit-learn's 8x8 digits (a fixed size: `--count` is refused)."""
    from service.data.builtin import write_digits

    if count is not None:
        raise DataError("--count: the digits data set has a fixed size (1,797 images)")
    return write_digits(uri, seed)


def images(uri: str, count: int | None, seed: int) -> dict[str, list[str]]:
    """32x32 RGB digit images on textured backgrounds, as PNG bytes (`service.data.images`)."""
    from service.data.images import DEFAULT_COUNT, write_images

    return write_images(uri, DEFAULT_COUNT if count is None else count, seed)


DATASETS: dict[str, Builder] = {
    "digits": digits,
    "images": images,
    "text": text.build,
}
