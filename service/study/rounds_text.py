"""A round appended to a study file as text: the lines go after the last line of the
top-level `rounds:` block list, and every other byte of the file (its comments, its order, its
flow-style items) stays as it was. No YAML round trip: the caller parses the result again and
checks it is the study it had plus the one round."""

from __future__ import annotations

import json
import re
from typing import Any

from service.core.errors import SpecError
from service.study.search import HParam

_ROUNDS = re.compile(r"^rounds:[ \t]*(#.*)?$")
_TOP_LEVEL = re.compile(r"^[^\s#-]")
_PLAIN = re.compile(r"^[a-z_][a-z0-9_-]*$")
"""A string written without quotes (a name, a kind), unless YAML reads it as something else."""
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def rounds_block(text: str, source: str) -> tuple[int, int, int]:
    """(index of the `rounds:` line, index after the block's last item line, the items'
    indent) among `text`'s lines. SpecError when the file has no block-style `rounds:` list
    (`rounds: [...]` in flow style cannot take a block item)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _ROUNDS.match(line)), None)
    if start is None:
        raise SpecError(
            f"{source}: rounds: is not a block list (`rounds:` then `- ...` lines); append by hand"
        )
    end, indent = start + 1, None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if _TOP_LEVEL.match(line):
            break
        stripped = line.lstrip(" ")
        if stripped.startswith("- ") or stripped == "-":
            indent = len(line) - len(stripped) if indent is None else indent
        if stripped and (not stripped.startswith("#") or stripped != line):
            end = i + 1  # an item's line, or an indented comment (a column-0 one may head what follows)
    if indent is None:
        raise SpecError(f"{source}: rounds: has no `- ` items; append by hand")
    return start, end, indent


def append_round(text: str, block: str, source: str) -> str:
    """`text` with `block` (whole lines, ending in a newline) inserted after the last line of
    the `rounds:` list."""
    _, end, _ = rounds_block(text, source)
    lines = text.splitlines(keepends=True)
    if end == len(lines) and lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines[:end]) + block + "".join(lines[end:])


def hparam_dict(hp: HParam) -> dict:
    """A search entry as the study file writes it."""
    if hp.role == "fixed" and hp.best_of is not None:
        return {"role": "fixed", "best_of": hp.best_of}
    if hp.role == "fixed":
        return {"role": "fixed", "value": hp.value}
    if hp.type == "choice":
        return {"role": hp.role, "type": "choice", "values": list(hp.values)}
    return {"role": hp.role, "type": hp.type, "min": hp.min, "max": hp.max, "scale": hp.scale}


def scalar(v: Any) -> str:
    """A YAML scalar that the study loader reads back as `v`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {scalar(x)}" for k, x in v.items()) + "}"
    text = str(v)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)
