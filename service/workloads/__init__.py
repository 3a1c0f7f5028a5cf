"""Workload registry: built-in names, or `module:Class` for a user's own workload, imported from
the study file's folder, the working directory or the installed packages (docs/workloads.md)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys

import pyarrow as pa
import torch

from service.core.errors import SpecError
from service.workloads.base import Workload
from service.workloads.digits import Digits, DigitsZero
from service.workloads.images import Images, ImagesDecoded
from service.workloads.lm import LanguageModel

BUILTIN: dict[str, type[Workload]] = {
    "digits": Digits,
    "digits_zero": DigitsZero,
    "lm": LanguageModel,
    "images": Images,
    "images_decoded": ImagesDecoded,
}


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
    except (ImportError, AttributeError, SyntaxError) as e:  # SyntaxError: names the file and line
        raise SpecError(
            f"workload: cannot load {name!r} ({e}); a module of your own is imported from the study "
            "file's folder or the working directory (docs/workloads.md)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise SpecError(f"workload: {name!r} is not a subclass of service.workloads.base.Workload")
    return cls()


def source_file(name: str) -> str | None:
    """The file that defines the workload's class (None if it has none)."""
    try:
        return inspect.getsourcefile(type(get(name)))
    except TypeError:  # a class without a source file (built in C, made at run time)
        return None


def import_path(study_file: str, cwd: str | None = None) -> list[str]:
    """The folders a user's own workload is imported from, first: the study file's folder (when
    it is a local file), then the working directory."""
    cwd = os.path.abspath(cwd or os.getcwd())
    folders = [] if "://" in study_file else [os.path.dirname(os.path.abspath(study_file))]
    return list(dict.fromkeys([*folders, cwd]))


def use_import_path(paths: list[str]) -> None:
    """Put `paths` first on this process's import path, in order."""
    for p in reversed(paths):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)


def job_env_vars() -> dict[str, str]:
    """The env_vars of the Ray job's own runtime env (`ray job submit --runtime-env-json`), in a
    submitted job's driver; empty elsewhere."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    return (job.get("runtime_env") or {}).get("env_vars") or {}


def ray_env(paths: list[str], cwd: str | None = None) -> dict[str, str]:
    """The job's PYTHONPATH that puts `paths` on the import path of every Ray process of the job
    (coordinator, trials, training and input workers), ahead of the driver's own PYTHONPATH.
    A folder inside the working directory is given twice: relative to it (a worker of a
    `ray job submit --working-dir` job resolves it in its own copy of that directory) and
    absolute (a worker started elsewhere on this machine). Nothing when the Ray job's own
    runtime env sets PYTHONPATH (Ray refuses a second value): that one is used as it is."""
    if "PYTHONPATH" in job_env_vars():
        return {}
    cwd = os.path.abspath(cwd or os.getcwd())
    entries = []
    for p in paths:
        inside = os.path.commonpath([p, cwd]) == cwd
        entries += [os.path.relpath(p, cwd), p] if inside else [p]
    entries += [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(entries))} if entries else {}


def check_contract(workload: Workload, table: pa.Table, hparams: dict | None = None) -> None:
    """What the service relies on, checked on a few rows before anything starts: `to_batch`
    gives a 'label' row per table row, the untrained model (built with `hparams`, the rest at
    the workload's defaults) reads them, its outputs are [rows, num_classes] for a classifier,
    and `loss` and every one of `metric_names` are one value per row."""
    n, where = table.num_rows, f"workload {workload.name or type(workload).__name__}"
    batch = workload.to_batch(table)
    if "label" not in batch or len(batch["label"]) != n:
        raise SpecError(f"{where}: to_batch must return a 'label' tensor with one row per table row")
    model = workload.build_model(workload.model_hparams(hparams or {}))
    model.eval()  # one row through BatchNorm in training mode is an error
    with torch.no_grad():
        outputs = workload.forward(model, batch)
        if workload.num_classes is not None and tuple(outputs.shape) != (n, workload.num_classes):
            raise SpecError(
                f"{where}: num_classes = {workload.num_classes} needs outputs of shape [batch, "
                f"{workload.num_classes}], but the model returns {list(outputs.shape)} for {n} row(s)"
            )
        checks = {"loss()": workload.loss(outputs, batch)}
        metrics = workload.metrics(outputs, batch)
    checks.update({f"metrics()[{m!r}] (metric_names)": metrics.get(m) for m in workload.metric_names})
    for what, values in checks.items():
        if values is None or tuple(values.shape) != (n,):
            got = "missing" if values is None else f"shape {list(values.shape)}"
            raise SpecError(f"{where}: {what} must be one value per row, shape [{n}]; got {got}")
