"""Workload registry: built-in names, or `package.module:Class` for a user's own workload."""

from __future__ import annotations

import importlib

from service.errors import SpecError
from service.workloads.base import Workload
from service.workloads.digits import Digits, DigitsZero

BUILTIN: dict[str, type[Workload]] = {"digits": Digits, "digits_zero": DigitsZero}


def get(name: str) -> Workload:
    if name in BUILTIN:
        return BUILTIN[name]()
    if ":" not in name:
        raise SpecError(
            f"workload: unknown workload {name!r} (built-in: {', '.join(BUILTIN)}; "
            "or give package.module:Class)"
        )
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SpecError(f"workload: cannot load {name!r} ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise SpecError(f"workload: {name!r} is not a subclass of service.workloads.base.Workload")
    return cls()
