"""Strict YAML -> typed frozen dataclasses, the machinery under `service.study.spec`.

`load_yaml` safe-loads YAML, refuses repeated keys and reads `1e-3` as a number. `build` converts
the parsed value to a type (dataclass, Union, Literal, tuple, dict, scalar), raising `SpecError`
whose message starts with the dotted path of the offending field; a dataclass with an `errors()`
method has its own checks run the same way.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal

import yaml

from service.core.errors import SpecError

Scalar = str | int | float | bool


class StrictLoader(yaml.SafeLoader):
    """Safe YAML (no object construction), plus: a repeated key is an error (not silently
    last-wins), and `1e-3` is a number (YAML 1.1 wants a dot, so plain PyYAML reads it as a string)."""


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str, source: str) -> dict:
    """Parse a YAML mapping; SpecError naming `source` (and the line) otherwise."""
    try:
        raw = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the study file must be a mapping of keys to values")
    return raw


def _join(path: str, name: str) -> str:
    if name.startswith("["):
        return f"{path}{name}"
    return f"{path}.{name}" if path else name


def _where(path: str) -> str:
    """How an error names the place at `path`: the study file itself at the top."""
    return path or "<study>"


def build(tp, raw, path: str = ""):
    """Convert `raw` (parsed YAML) to type `tp`, raising SpecError with `path` on a mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, raw, path)
    if origin in (typing.Union, types.UnionType):
        return _build_union(tp, raw, path)
    where = _where(path)
    if origin is Literal:
        options = typing.get_args(tp)
        if raw not in options:
            raise SpecError(f"{where}: must be one of {', '.join(map(str, options))} (got {raw!r})")
        return raw
    if origin is tuple:
        if not isinstance(raw, list):
            raise SpecError(f"{where}: must be a list (got {kind(raw)})")
        inner = typing.get_args(tp)[0]
        return tuple(build(inner, x, f"{path}[{i}]") for i, x in enumerate(raw))
    if origin is dict:
        return _build_dict(tp, raw, path)
    return _build_scalar(tp, raw, where)


def _build_dataclass(tp, raw, path: str):
    """A dataclass from a mapping: no unknown key, every field without a default given, then the
    dataclass's own `errors()` checks."""
    if not isinstance(raw, dict):
        raise SpecError(f"{_where(path)}: must be a mapping (got {kind(raw)})")
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp) if f.metadata.get("in_file", True)}
    for key in raw:
        if key not in fields:
            known = ", ".join(fields)
            raise SpecError(f"{_join(path, str(key))}: unknown key (known: {known})")
    kwargs = {}
    for name, f in fields.items():
        if name in raw:
            kwargs[name] = build(hints[name], raw[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{_join(path, name)}: required")
    obj = tp(**kwargs)
    for sub, msg in obj.errors() if hasattr(obj, "errors") else ():
        raise SpecError(f"{_join(path, sub)}: {msg}")
    return obj


def _build_union(tp, raw, path: str):
    """An optional value (`X | None`), or a `Scalar`: any finite string, number or boolean."""
    args = typing.get_args(tp)
    if raw is None and type(None) in args:
        return None
    if tp == Scalar or set(args) >= {str, int, float, bool}:
        where = _where(path)
        if isinstance(raw, float) and not math.isfinite(raw):
            raise SpecError(f"{where}: must be finite (got {raw})")
        if isinstance(raw, str | int | float | bool):
            return raw
        raise SpecError(f"{where}: must be a scalar (got {kind(raw)})")
    (inner,) = [a for a in args if a is not type(None)]
    return build(inner, raw, path)


def _build_dict(tp, raw, path: str):
    """A mapping of hyperparameter names (identifiers) to values of the dict's value type."""
    if not isinstance(raw, dict):
        raise SpecError(f"{_where(path)}: must be a mapping (got {kind(raw)})")
    inner = typing.get_args(tp)[1]
    out = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise SpecError(f"{_join(path, str(k))}: not a valid hyperparameter name")
        out[k] = build(inner, v, _join(path, k))
    return out


def _build_scalar(tp, raw, where: str):
    """A bool, int, float (finite) or str; an int is a number, a bool is neither."""
    if tp is bool:
        if not isinstance(raw, bool):
            raise SpecError(f"{where}: must be true or false (got {kind(raw)})")
        return raw
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise SpecError(f"{where}: must be an integer (got {kind(raw)})")
        return raw
    if tp is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise SpecError(f"{where}: must be a number (got {kind(raw)})")
        if raw != raw or raw in (float("inf"), float("-inf")):
            raise SpecError(f"{where}: must be finite (got {raw})")
        return float(raw)
    if tp is str:
        if not isinstance(raw, str):
            raise SpecError(f"{where}: must be a string (got {kind(raw)})")
        return raw
    raise AssertionError(f"spec loader has no rule for {tp!r}")  # internal invariant


def kind(v: Any) -> str:
    if v is None:
        return "nothing"
    if isinstance(v, bool):
        return f"boolean {v}".lower()
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        return f"string {v!r}"
    return f"{type(v).__name__} {v!r}"


def positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if v is not None and v <= 0:
            yield n, f"must be > 0 (got {v})"


def non_negative(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if v is not None and v < 0:
            yield n, f"must be >= 0 (got {v})"
