"""An import inside a function runs only when the function does, so a name moved to another
module breaks a lazy `from service.x import name` on a path that no test runs, without any
import failing at collection: bench/trial_overhead.py still imported `study_trainable` from
`tune_run` after it moved to `tune_fit`, found only by `make bench`. Every import of the
project's own modules in service/, bench/ and tests/, at any depth, names something that exists."""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
OWN = ("service", "bench", "tests")


def own_imports():
    """(file:line, module, name or None) of every absolute import of the project's modules."""
    for folder in OWN:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in OWN:
                    names = [(node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [(a.name, None) for a in node.names if a.name.split(".")[0] in OWN]
                else:
                    continue
                yield from ((f"{path.relative_to(ROOT)}:{node.lineno}", *n) for n in names)


def missing(module: str, name: str | None) -> str | None:
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        return str(e)
    if name in (None, "*") or hasattr(found, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")  # a submodule not imported yet
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_every_import_of_the_projects_own_names_resolves():
    imports = list(own_imports())
    assert any(module == "service.orchestration.tune_fit" for _, module, _ in imports)  # lazy ones seen
    broken = [f"{where}: {why}" for where, module, name in imports if (why := missing(module, name))]
    assert not broken, broken
