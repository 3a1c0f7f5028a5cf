"""The architecture as a checked fact: `service/`'s packages are layers, each importing only
itself and the layers below it, and Ray is imported only at the edges (`orchestration/` and the
CLI). Every import counts, including those inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
import pathlib

import pytest

SERVICE = pathlib.Path(__file__).resolve().parents[2] / "service"

# Lowest first. Packages on one line are one layer (they may import each other).
LAYERS = [
    {"core"},
    {"workloads", "nn"},
    {"data"},
    {"study"},
    {"planning"},
    {"distributed"},
    {"evaluation"},
    {"trainer"},
    {"analysis"},
    {"tracking"},
    {"report"},
    {"orchestration"},
    {"cli", "__main__"},
]
RAY_ALLOWED = {"orchestration", "cli"}


def layer_of(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"service/{part} is in no layer: add it to LAYERS in {__file__}")


def imported_modules(path: pathlib.Path, source: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in a module's source; relative imports are
    resolved against the module's package."""
    package = ["service", *path.relative_to(SERVICE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            if module == "service":
                found += [(node.lineno, f"service.{alias.name}") for alias in node.names]
    return found


def violations(path: pathlib.Path, source: str) -> list[str]:
    """What in one module of service/ breaks the layer rule or the Ray rule."""
    here = path.relative_to(SERVICE).with_suffix("").parts[0]
    out = []
    for line, module in imported_modules(path, source):
        where = f"service/{path.relative_to(SERVICE)}:{line} imports {module}"
        top = module.split(".")
        if top[0] == "ray" and here not in RAY_ALLOWED:
            out.append(f"{where}: Ray is imported only in {sorted(RAY_ALLOWED)}")
        if top[0] == "service" and len(top) > 1 and top[1] != "__init__":
            if layer_of(top[1]) > layer_of(here):
                out.append(f"{where}: a lower layer ({here}) imports a higher one ({top[1]})")
    return out


def all_violations() -> list[str]:
    out = []
    for path in sorted(SERVICE.rglob("*.py")):
        if path.parent == SERVICE and path.stem == "__init__":
            continue
        out += violations(path, path.read_text())
    return out


def test_every_import_in_service_follows_the_layers_and_the_ray_rule():
    assert all_violations() == []


def test_every_package_of_service_is_a_layer():
    packages = {p.name for p in SERVICE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in SERVICE.glob("*.py")} - {"__init__"}
    for name in packages | modules:
        layer_of(name)


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("trainer/loop.py", "import ray", "Ray is imported only"),
        ("trainer/loop.py", "from ray import train", "Ray is imported only"),
        ("data/loader.py", "    import ray.data", "Ray is imported only"),
        ("study/spec.py", "from service.tracking import trial_table", "lower layer (study)"),
        ("analysis/verdicts.py", "from service import report", "lower layer (analysis)"),
        ("data/files.py", "from ..planning import trial", "lower layer (data)"),
        ("evaluation/offline.py", "from service.trainer import loop", "lower layer (evaluation)"),
        ("distributed/checkpoint.py", "from service.evaluation import run", "lower layer (distributed)"),
    ],
)
def test_the_rule_catches_an_import_added_where_it_does_not_belong(module, line, broken):
    """The checker, run on a real module with one line added, names the line."""
    path = SERVICE / module
    source = path.read_text()
    if line.startswith(" "):
        source += "\n\ndef _added():\n" + line + "\n"
    else:
        source = line + "\n" + source
    found = violations(path, source)
    assert len(found) == 1 and broken in found[0], found
