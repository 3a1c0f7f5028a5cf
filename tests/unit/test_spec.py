"""Study file loading: round trips, defaults, and one-line errors naming the dotted path of the bad field."""

import copy
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.core.errors import SpecError
from service.study import spec
from service.study.checks import check_workload
from service.study.search import HParam, Round
from service.study.training import Scaling, Schedule
from tests.helpers.studies import MINIMAL_STUDY as MINIMAL

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "studies" / "digits-demo.yaml"


@pytest.fixture
def raw() -> dict:
    """The demo study as plain parsed YAML; each bad case changes exactly one thing in it."""
    return yaml.safe_load(DEMO.read_text(encoding="utf-8"))


FULL = {
    "name": "full_study-2",
    "description": "every kind of field",
    "workload": "digits_zero",
    "data": {"train": "gs://b/train/*.parquet", "validation": "gs://b/val", "test": "gs://b/test"},
    "storage": "gs://b/studies",
    "scaling": {"num_hosts": 2, "workers_per_host": 4, "use_gpu": True, "cpus_per_worker": 2.5},
    "training": {
        "max_train_steps": 1000,
        "batch_size": 128,
        "eval_batch_size": 512,
        "eval_every_steps": 100,
        "num_checkpoints_to_keep": 1,
        "metric": "validation/loss",
        "mode": "min",
        "seed": 42,
        "optimizer": "adamw",
        "schedule": {"kind": "linear", "decay_steps": 300, "final_lr_fraction": 0.01},
        "ghost_batch_norm": True,
        "virtual_batch_size": 32,
    },
    "search": {
        "learning_rate": {"role": "nuisance", "type": "float", "min": 1e-4, "max": 0.1, "scale": "log"},
        "beta1": {"role": "nuisance", "min": 0.8, "max": 0.99},
        "width": {"role": "scientific", "type": "int", "min": 8, "max": 64, "scale": "log"},
        "weight_decay": {"role": "scientific", "type": "choice", "values": [0.0, 1e-4, 1e-3]},
        "beta2": {"role": "fixed", "value": 0.999},
        "warmup_steps": {"role": "fixed", "value": 10},
    },
    "rounds": [
        {"name": "explore", "num_trials": 20, "max_concurrent_trials": 4, "seed": 3},
        {"name": "exploit", "num_trials": 5, "max_train_steps": 2000},
    ],
}


# ----------------------------------------------------------------------------- valid files


def test_demo_file_loads_with_its_values():
    s = spec.load_file(DEMO)
    assert s.name == "digits-demo" and s.workload == "digits"
    assert s.training.max_train_steps == 300 and s.training.eval_batch_size == 256
    assert s.training.schedule == Schedule(kind="cosine", warmup_steps=20)
    assert s.search["learning_rate"] == HParam(role="nuisance", type="float", min=0.003, max=1.0, scale="log")
    assert s.fixed_hparams == {"weight_decay": 0.0005, "width": 16}
    assert list(s.searched_hparams) == ["learning_rate", "momentum"]
    assert s.rounds == (
        Round(name="explore", num_trials=6),
        Round(name="exploit", kind="extend", num_trials=1, step_multiplier=2),
    )
    assert s.round_steps(s.rounds[1]) == 600
    check_workload(s)  # the demo's metric and hyperparameters are known to the digits workload


def test_defaults_are_applied():
    s = spec.load_dict(copy.deepcopy(MINIMAL))
    assert s.scaling == Scaling(num_hosts=1, workers_per_host=1, use_gpu=False, cpus_per_worker=1.0)
    assert s.scaling.world_size == 1
    assert s.training.eval_batch_size is None
    assert s.training.resolved_eval_batch_size == 32  # = batch_size
    assert s.training.schedule == Schedule(
        kind="cosine", warmup_steps=0, decay_steps=None, final_lr_fraction=0.0
    )
    assert (s.training.metric, s.training.mode, s.training.seed) == ("validation/error", "min", 0)
    assert s.training.num_checkpoints_to_keep == 3
    assert s.storage == "./playbook-studies" and s.description == "" and s.data.test is None
    hp = s.search["learning_rate"]
    assert (hp.type, hp.scale, hp.values, hp.value) == ("float", "linear", None, None)
    assert isinstance(hp.max, float) and hp.max == 1.0  # an int bound of a float range becomes a float
    assert s.rounds[0] == Round(
        name="r1", num_trials=4, kind="quasi_random", max_concurrent_trials=0, max_train_steps=None, seed=0
    )
    assert s.study_uri == "./playbook-studies/tiny"


def test_loaded_study_is_frozen():
    s = spec.load_dict(copy.deepcopy(MINIMAL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.training.batch_size = 1  # type: ignore[misc]


def _is_plain(v) -> bool:
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_is_plain(x) for x in v)
    return v is None or isinstance(v, str | int | float | bool)


@pytest.mark.parametrize("source", ["minimal", "full", "demo"])
def test_round_trips(source):
    raw = {"minimal": MINIMAL, "full": FULL}.get(source) or yaml.safe_load(DEMO.read_text())
    s = spec.load_dict(copy.deepcopy(raw))
    d = spec.to_dict(s)
    assert _is_plain(d)
    assert spec.load_dict(d) == s
    text = spec.dump_yaml(s)
    assert spec.load_text(text) == s
    assert yaml.safe_load(text) == d


def test_full_study_values():
    s = spec.load_dict(copy.deepcopy(FULL))
    assert s.scaling.world_size == 8
    assert s.search["weight_decay"].values == (0.0, 1e-4, 1e-3)  # a YAML list becomes a tuple
    assert s.search["width"].min == 8.0
    assert s.rounds[1].max_train_steps == 2000 and s.rounds[0].seed == 3
    assert s.training.schedule.decay_steps == 300
    assert (s.training.ghost_batch_norm, s.training.virtual_batch_size) == (True, 32)
    check_workload(s)


def test_ghost_batch_norm_defaults():
    s = spec.load_dict(copy.deepcopy(MINIMAL))
    assert (s.training.ghost_batch_norm, s.training.virtual_batch_size) == (False, 64)


# ----------------------------------------------------------------------------- bad values


def _set(path: str, value):
    """A change to the raw study: set (or, with DELETE, remove) the value at a dotted path."""

    def apply(raw):
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = copy.deepcopy(value)

    return apply


DELETE = object()


def _both(*changes):
    def apply(raw):
        for change in changes:
            change(raw)

    return apply


FSDP_ON_2 = (_set("scaling.workers_per_host", 2), _set("scaling.strategy", "fsdp"))

BAD = [
    # (id, change, dotted path the message must start with)
    ("unknown-top-level-key", _set("lerning_rate", 0.1), "lerning_rate"),
    ("unknown-nested-key", _set("training.evl_every_steps", 10), "training.evl_every_steps"),
    ("unknown-schedule-key", _set("training.schedule.warmpu_steps", 10), "training.schedule.warmpu_steps"),
    ("unknown-hparam-key", _set("search.momentum.maximum", 1), "search.momentum.maximum"),
    ("unknown-round-key", _set("rounds.0.trials", 3), "rounds[0].trials"),
    ("missing-max-train-steps", _set("training.max_train_steps", DELETE), "training.max_train_steps"),
    ("missing-workload", _set("workload", DELETE), "workload"),
    ("missing-data-train", _set("data.train", DELETE), "data.train"),
    ("missing-rounds", _set("rounds", DELETE), "rounds"),
    ("missing-round-num-trials", _set("rounds.0.num_trials", DELETE), "rounds[0].num_trials"),
    ("missing-role", _set("search.momentum.role", DELETE), "search.momentum.role"),
    ("string-for-int", _set("training.batch_size", "64"), "training.batch_size"),
    ("float-for-int", _set("training.max_train_steps", 300.0), "training.max_train_steps"),
    ("bool-for-int", _set("training.max_train_steps", True), "training.max_train_steps"),
    ("bool-for-float", _set("scaling.cpus_per_worker", True), "scaling.cpus_per_worker"),
    ("string-for-float", _set("search.learning_rate.min", "1e-3"), "search.learning_rate.min"),
    ("int-for-bool", _set("scaling.use_gpu", 1), "scaling.use_gpu"),
    ("int-for-string", _set("data.train", 5), "data.train"),
    ("null-for-string", _set("description", None), "description"),
    ("list-for-mapping", _set("training", [1, 2]), "training"),
    ("list-for-nested-mapping", _set("training.schedule", ["cosine"]), "training.schedule"),
    ("string-for-search-mapping", _set("search", "learning_rate"), "search"),
    ("mapping-for-list", _set("rounds", {"name": "explore", "num_trials": 2}), "rounds"),
    ("scalar-for-round", _set("rounds.0", "explore"), "rounds[0]"),
    (
        "list-in-choice-values",
        _set("search.momentum", {"role": "nuisance", "type": "choice", "values": [1, [2]]}),
        "search.momentum.values[1]",
    ),
    ("negative-steps", _set("training.max_train_steps", -5), "training.max_train_steps"),
    ("zero-eval-every", _set("training.eval_every_steps", 0), "training.eval_every_steps"),
    ("zero-batch", _set("training.batch_size", 0), "training.batch_size"),
    ("zero-checkpoints", _set("training.num_checkpoints_to_keep", 0), "training.num_checkpoints_to_keep"),
    ("zero-hosts", _set("scaling.num_hosts", 0), "scaling.num_hosts"),
    ("zero-trials", _set("rounds.0.num_trials", 0), "rounds[0].num_trials"),
    ("negative-concurrency", _set("rounds.0.max_concurrent_trials", -1), "rounds[0].max_concurrent_trials"),
    ("zero-round-steps", _set("rounds.0.max_train_steps", 0), "rounds[0].max_train_steps"),
    ("negative-training-seed", _set("training.seed", -1), "training.seed"),
    ("negative-round-seed", _set("rounds.0.seed", -3), "rounds[0].seed"),
    ("eval-every-above-max", _set("training.eval_every_steps", 301), "training.eval_every_steps"),
    ("eval-batch-below-batch", _set("training.eval_batch_size", 32), "training.eval_batch_size"),
    ("bad-metric", _set("training.metric", "error"), "training.metric"),
    ("min-above-max", _set("search.learning_rate.min", 2.0), "search.learning_rate.min"),
    ("log-min-zero", _set("search.learning_rate.min", 0), "search.learning_rate.min"),
    (
        "log-min-negative",
        _set("search.momentum", {"role": "nuisance", "min": -1, "max": 1, "scale": "log"}),
        "search.momentum.min",
    ),
    ("range-missing-max", _set("search.momentum.max", DELETE), "search.momentum.max"),
    (
        "int-fractional-bound",
        _set("search.momentum", {"role": "nuisance", "type": "int", "min": 1.5, "max": 4}),
        "search.momentum.min",
    ),
    (
        "choice-without-values",
        _set("search.momentum", {"role": "nuisance", "type": "choice"}),
        "search.momentum.values",
    ),
    (
        "choice-empty-values",
        _set("search.momentum", {"role": "nuisance", "type": "choice", "values": []}),
        "search.momentum.values",
    ),
    ("values-on-float", _set("search.momentum.values", [0.9]), "search.momentum.values"),
    ("fixed-without-value", _set("search.weight_decay", {"role": "fixed"}), "search.weight_decay.value"),
    ("fixed-with-range", _set("search.weight_decay.min", 0.1), "search.weight_decay.min"),
    ("value-on-searched", _set("search.momentum.value", 0.9), "search.momentum.value"),
    ("fixed-value-not-scalar", _set("search.width.value", [16, 32]), "search.width.value"),
    ("unknown-role", _set("search.momentum.role", "nuisanse"), "search.momentum.role"),
    ("unknown-scale", _set("search.learning_rate.scale", "log10"), "search.learning_rate.scale"),
    ("unknown-type", _set("search.momentum.type", "double"), "search.momentum.type"),
    ("unknown-mode", _set("training.mode", "minimize"), "training.mode"),
    ("unknown-optimizer", _set("training.optimizer", "lamb"), "training.optimizer"),
    ("unknown-schedule-kind", _set("training.schedule.kind", "step"), "training.schedule.kind"),
    ("unknown-round-kind", _set("rounds.0.kind", "bayesian"), "rounds[0].kind"),
    ("bad-hparam-name", _set("search.2nd_momentum", {"role": "fixed", "value": 1}), "search.2nd_momentum"),
    ("name-with-space", _set("name", "digits demo"), "name"),
    ("name-upper-case", _set("name", "Digits"), "name"),
    ("name-leading-dash", _set("name", "-digits"), "name"),
    ("name-too-long", _set("name", "a" * 64), "name"),
    ("bad-round-name", _set("rounds.0.name", "Explore!"), "rounds[0].name"),
    (
        "duplicate-round-names",
        _set("rounds", [{"name": "a", "num_trials": 1}, {"name": "a", "num_trials": 2}]),
        "rounds[1].name",
    ),
    ("no-rounds", _set("rounds", []), "rounds"),
    ("batch-not-divisible", _set("scaling.workers_per_host", 3), "training.batch_size"),
    (
        "eval-batch-not-divisible",
        _both(_set("scaling.workers_per_host", 4), _set("training.eval_batch_size", 250)),
        "training.eval_batch_size",
    ),
    (
        "warmup-equals-max-steps",
        _set("training.schedule.warmup_steps", 300),
        "training.schedule.warmup_steps",
    ),
    ("negative-warmup", _set("training.schedule.warmup_steps", -1), "training.schedule.warmup_steps"),
    ("decay-steps-with-cosine", _set("training.schedule.decay_steps", 10), "training.schedule.decay_steps"),
    (
        "final-fraction-above-one",
        _set("training.schedule.final_lr_fraction", 1.5),
        "training.schedule.final_lr_fraction",
    ),
    ("zero-virtual-batch", _set("training.virtual_batch_size", 0), "training.virtual_batch_size"),
    ("negative-virtual-batch", _set("training.virtual_batch_size", -64), "training.virtual_batch_size"),
    ("float-virtual-batch", _set("training.virtual_batch_size", 32.0), "training.virtual_batch_size"),
    ("string-for-ghost-bn", _set("training.ghost_batch_norm", "yes"), "training.ghost_batch_norm"),
    ("round-steps-within-warmup", _set("rounds.0.max_train_steps", 20), "rounds[0].max_train_steps"),
    ("learning-rate-missing", _set("search.learning_rate", DELETE), "search"),
    ("unknown-strategy", _set("scaling.strategy", "zero3"), "scaling.strategy"),
    (
        "find-unused-with-fsdp",
        _both(*FSDP_ON_2, _set("scaling.find_unused_parameters", True)),
        "scaling.find_unused_parameters",
    ),
    (
        "string-for-find-unused",
        _set("scaling.find_unused_parameters", "yes"),
        "scaling.find_unused_parameters",
    ),
    ("fsdp-with-one-worker", _set("scaling.strategy", "fsdp"), "scaling.strategy"),
    (
        "shard-group-without-fsdp",
        _both(_set("scaling.workers_per_host", 2), _set("scaling.shard_group_size", 2)),
        "scaling.shard_group_size",
    ),
    (
        "shard-group-of-one",
        _both(*FSDP_ON_2, _set("scaling.shard_group_size", 1)),
        "scaling.shard_group_size",
    ),
    (
        "shard-group-not-dividing",
        _both(
            _set("scaling.workers_per_host", 4),
            _set("scaling.strategy", "fsdp"),
            _set("scaling.shard_group_size", 3),
        ),
        "scaling.shard_group_size",
    ),
    ("zero-shard-group", _both(*FSDP_ON_2, _set("scaling.shard_group_size", 0)), "scaling.shard_group_size"),
    ("fsdp-with-fp16", _both(*FSDP_ON_2, _set("training.precision", "fp16")), "training.precision"),
    ("fsdp-with-compile", _both(*FSDP_ON_2, _set("training.compile", True)), "training.compile"),
]

# Hyperparameters and round fields nothing would read (or that could not run), each refused
# with the field's name and why. The demo: nesterov, cosine schedule with warmup 20, 300 steps,
# rounds explore (quasi_random) and exploit (extend x2).
WARMUP = {"role": "nuisance", "type": "int", "min": 1, "max": 40}
NO_SCHEDULE_WARMUP = _set("training.schedule.warmup_steps", DELETE)
UNREAD = [
    # (id, change, dotted path, words the reason must contain)
    (
        "momentum-with-adamw",
        _set("training.optimizer", "adamw"),
        "search.momentum",
        "not read by optimizer adamw (only by sgd_momentum, nesterov)",
    ),
    (
        "beta1-with-nesterov",
        _set("search.beta1", {"role": "fixed", "value": 0.9}),
        "search.beta1",
        "not read by optimizer nesterov (only by adamw)",
    ),
    (
        "beta2-with-sgd",
        _both(
            _set("training.optimizer", "sgd_momentum"), _set("search.beta2", {"role": "fixed", "value": 0.99})
        ),
        "search.beta2",
        "not read by optimizer sgd_momentum",
    ),
    (
        "warmup-searched-and-in-schedule",
        _set("search.warmup_steps", WARMUP),
        "search.warmup_steps",
        "also set in training.schedule.warmup_steps",
    ),
    (
        "warmup-float",
        _both(NO_SCHEDULE_WARMUP, _set("search.warmup_steps", {"role": "nuisance", "min": 1, "max": 40})),
        "search.warmup_steps",
        "a step count",
    ),
    (
        "warmup-fractional-choice",
        _both(NO_SCHEDULE_WARMUP, _set("search.warmup_steps", {"role": "fixed", "value": 2.5})),
        "search.warmup_steps",
        "must be an integer",
    ),
    (
        "warmup-negative",
        _both(NO_SCHEDULE_WARMUP, _set("search.warmup_steps", {**WARMUP, "min": -1})),
        "search.warmup_steps",
        "must be >= 0",
    ),
    (
        "warmup-max-reaches-round-1",
        _both(NO_SCHEDULE_WARMUP, _set("search.warmup_steps", {**WARMUP, "max": 300})),
        "search.warmup_steps",
        "the longest warmup (300) must be < max_train_steps of round explore (300)",
    ),
    (
        "warmup-max-reaches-a-shorter-extend-round",
        _both(
            NO_SCHEDULE_WARMUP,
            _set("search.warmup_steps", {**WARMUP, "max": 200}),
            _set("rounds.1.step_multiplier", 0.5),
        ),
        "search.warmup_steps",
        "the longest warmup (200) must be < max_train_steps of round exploit (150)",
    ),
    (
        "decay-steps-with-cosine",
        _set("search.decay_steps", {"role": "fixed", "value": 50}),
        "search.decay_steps",
        "not read by a cosine schedule (training.schedule.kind; only by linear)",
    ),
    (
        "final-fraction-with-constant",
        _both(
            _set("training.schedule.kind", "constant"),
            _set("search.final_lr_fraction", {"role": "nuisance", "min": 0.0, "max": 0.1}),
        ),
        "search.final_lr_fraction",
        "not read by a constant schedule (training.schedule.kind; only by linear, cosine)",
    ),
    (
        "final-fraction-in-constant-schedule",
        _both(_set("training.schedule.kind", "constant"), _set("training.schedule.final_lr_fraction", 0.1)),
        "training.schedule.final_lr_fraction",
        "a constant schedule does not decay",
    ),
    (
        "final-fraction-above-one",
        _set("search.final_lr_fraction", {"role": "nuisance", "min": 0.0, "max": 1.5}),
        "search.final_lr_fraction",
        "must be in [0, 1]",
    ),
    (
        "searched-decay-too-long",
        _both(
            _set("training.schedule.kind", "linear"),
            _set("search.decay_steps", {"role": "nuisance", "type": "int", "min": 10, "max": 290}),
        ),
        "search.decay_steps",
        "warmup + decay_steps (up to 20 + 290) must be <= max_train_steps of round explore (300)",
    ),
    (
        "searched-warmup-and-decay-too-long-together",
        _both(
            _set("training.schedule.kind", "linear"),
            _set("training.schedule.warmup_steps", DELETE),
            _both(
                _set("search.warmup_steps", {"role": "nuisance", "type": "int", "min": 0, "max": 30}),
                _set("search.decay_steps", {"role": "nuisance", "type": "int", "min": 60, "max": 280}),
            ),
        ),
        "search.warmup_steps and search.decay_steps",
        "warmup + decay_steps (up to 30 + 280) must be <= max_train_steps of round explore (300)",
    ),
    (
        "linear-extend-shorter-than-its-source",
        _both(_set("training.schedule.kind", "linear"), _set("rounds.1.step_multiplier", 0.5)),
        "rounds[1].step_multiplier",
        "shorter than the round it extends (300), whose linear decay it must keep",
    ),
    (
        "step-multiplier-on-quasi-random",
        _set("rounds.0.step_multiplier", 3),
        "rounds[0].step_multiplier",
        "only applies to kind: extend (kind is quasi_random)",
    ),
    (
        "from-round-on-quasi-random",
        _set("rounds.0.from_round", "explore"),
        "rounds[0].from_round",
        "only applies to kind: extend",
    ),
    (
        "seed-on-extend",
        _set("rounds.1.seed", 4),
        "rounds[1].seed",
        "only applies to kind: quasi_random or bayesian (kind is extend)",
    ),
    (
        "step-multiplier-and-max-steps",
        _set("rounds.1.max_train_steps", 900),
        "rounds[1].step_multiplier",
        "give max_train_steps or step_multiplier, not both",
    ),
]


@pytest.mark.parametrize("change,path,why", [u[1:] for u in UNREAD], ids=[u[0] for u in UNREAD])
def test_unread_or_impossible_hyperparameters_are_refused(raw, change, path, why):
    change(raw)
    with pytest.raises(SpecError) as e:
        spec.load_dict(raw)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and why in msg and "\n" not in msg, msg


def test_schedule_hyperparameters_that_are_read_are_accepted(raw):
    del raw["training"]["schedule"]["warmup_steps"]
    raw["training"]["schedule"]["kind"] = "linear"
    raw["search"]["warmup_steps"] = {"role": "nuisance", "type": "int", "min": 0, "max": 100}
    raw["search"]["decay_steps"] = {"role": "nuisance", "type": "choice", "values": [50, 200]}
    raw["search"]["final_lr_fraction"] = {"role": "fixed", "value": 0}
    s = spec.load_dict(raw)  # 100 + 200 <= 300; the extend round (600) is longer
    assert s.searched_hparams["warmup_steps"].max == 100
    raw["training"]["optimizer"] = "adamw"
    del raw["search"]["momentum"]
    raw["search"]["beta1"] = {"role": "nuisance", "min": 0.8, "max": 0.95}
    assert spec.load_dict(raw).training.optimizer == "adamw"


@pytest.mark.parametrize("change,path", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_value_names_dotted_path(raw, change, path):
    change(raw)
    with pytest.raises(SpecError) as e:
        spec.load_dict(raw)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    assert len(msg) > len(path) + 2  # says what is wrong, not only where


def test_documented_messages(raw):
    # The two message shapes the spec module documents, in full.
    bad = copy.deepcopy(raw)
    bad["training"]["eval_every_steps"] = 0
    with pytest.raises(SpecError, match=r"^training\.eval_every_steps: must be > 0 \(got 0\)$"):
        spec.load_dict(bad)
    del raw["training"]["max_train_steps"]
    with pytest.raises(SpecError, match=r"^training\.max_train_steps: required$"):
        spec.load_dict(raw)


@pytest.mark.parametrize(
    "schedule,path",
    [
        ({"kind": "linear", "warmup_steps": 20, "decay_steps": 281}, "training.schedule.decay_steps"),
        ({"kind": "linear", "decay_steps": 0}, "training.schedule.decay_steps"),
    ],
)
def test_bad_linear_schedule(raw, schedule, path):
    raw["training"]["schedule"] = schedule
    with pytest.raises(SpecError, match=rf"^{re.escape(path)}: "):
        spec.load_dict(raw)


def test_linear_schedule_filling_all_steps_is_valid(raw):
    raw["training"]["schedule"] = {"kind": "linear", "warmup_steps": 20, "decay_steps": 280}
    assert spec.load_dict(raw).training.schedule.decay_steps == 280


def test_round_override_must_leave_room_for_decay(raw):
    raw["training"]["schedule"] = {"kind": "linear", "warmup_steps": 20, "decay_steps": 100}
    raw["rounds"][0]["max_train_steps"] = 119
    with pytest.raises(SpecError, match=r"^rounds\[0\]\.max_train_steps: "):
        spec.load_dict(raw)
    raw["rounds"][0]["max_train_steps"] = 120
    assert spec.load_dict(raw).rounds[0].max_train_steps == 120


@pytest.mark.parametrize(
    "path,value",
    [
        ("search.learning_rate.min", float("nan")),
        ("search.momentum.max", float("inf")),
        ("scaling.cpus_per_worker", float("-inf")),
        ("search.weight_decay.value", float("nan")),
    ],
)
def test_non_finite_float_in_yaml(raw, path, value):
    _set(path, value)(raw)
    text = yaml.safe_dump(raw)
    assert ".nan" in text or ".inf" in text  # YAML's own spelling of non-finite floats
    with pytest.raises(SpecError, match=rf"^{re.escape(path)}: must be finite"):
        spec.load_text(text)


def test_malformed_yaml_names_source_and_line():
    lines = DEMO.read_text().splitlines()
    bad_line = 7
    lines.insert(bad_line - 1, "oops: a: b")  # "mapping values are not allowed here"
    with pytest.raises(SpecError) as e:
        spec.load_text("\n".join(lines), source="my-study.yaml")
    msg = str(e.value)
    assert msg.startswith("my-study.yaml: ")
    assert f"line {bad_line}" in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n", ""])
def test_top_level_must_be_a_mapping(text):
    with pytest.raises(SpecError, match=r"^s\.yaml: .*mapping"):
        spec.load_text(text, source="s.yaml")


def test_load_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match=rf"^{re.escape(str(missing))}: "):
        spec.load_file(missing)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(SpecError, match=rf"^{re.escape(str(binary))}: "):
        spec.load_file(binary)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=rf"^{re.escape(str(bad))}: not valid YAML"):
        spec.load_file(bad)


# ----------------------------------------------------------------------------- checks against the workload


@pytest.mark.parametrize(
    "change,path",
    [
        (_set("search.mixup", {"role": "nuisance", "min": 0.0, "max": 0.5}), "search.mixup"),
        (_set("search.widht", {"role": "fixed", "value": 8}), "search.widht"),
        (_set("training.metric", "validation/accuracy"), "training.metric"),
        (_set("training.metric", "train/error"), "training.metric"),
        (_set("workload", "no_such_workload"), "workload"),
    ],
    ids=["unknown-hparam", "misspelled-hparam", "unreported-metric", "train-metric", "unknown-workload"],
)
def test_check_workload_names_the_field(raw, change, path):
    change(raw)
    study = spec.load_dict(raw)  # the file itself is well formed
    with pytest.raises(SpecError) as e:
        check_workload(study)
    assert str(e.value).startswith(f"{path}: "), str(e.value)


# ----------------------------------------------------------------------------- CLI

CLI_CASES = {
    # name: (change to the demo file or raw text, dotted path in the error; None = valid)
    "valid": (None, None),
    "unknown-key": (_set("training.evl_every_steps", 10), "training.evl_every_steps"),
    "unknown-hparam": (_set("search.mixup", {"role": "fixed", "value": 0.1}), "search.mixup"),
    "momentum-with-adamw": (_set("training.optimizer", "adamw"), "search.momentum"),
    "malformed-yaml": ("name: demo\ntraining: [\n", "{file}"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Run `python -m service validate` on every case at once (each start imports torch)."""
    tmp = tmp_path_factory.mktemp("cli")
    procs = {}
    for name, (change, _) in CLI_CASES.items():
        path = tmp / f"{name}.yaml"
        if isinstance(change, str):
            path.write_text(change)
        else:
            raw = yaml.safe_load(DEMO.read_text())
            if change is not None:
                change(raw)
            path.write_text(yaml.safe_dump(raw))
        procs[name] = (
            path,
            subprocess.Popen(
                [sys.executable, "-m", "service", "validate", str(path)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    results = {}
    for name, (path, proc) in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (path, proc.returncode, out, err)
    return results


def test_cli_validate_accepts_valid_file(cli_results):
    _, rc, out, err = cli_results["valid"]
    assert rc == 0, err
    assert out.startswith("ok: study digits-demo") and err == ""


@pytest.mark.parametrize("name", [n for n, (_, p) in CLI_CASES.items() if p is not None])
def test_cli_validate_reports_one_line_and_exits_2(cli_results, name):
    path, rc, out, err = cli_results[name]
    dotted = CLI_CASES[name][1].format(file=path)
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"playbook: error: {dotted}: "), lines[0]


def test_exponent_without_a_dot_is_a_number():
    text = DEMO.read_text(encoding="utf-8").replace("min: 0.003", "min: 3e-3")
    assert "3e-3" in text
    assert spec.load_text(text).search["learning_rate"].min == 0.003


def test_repeated_key_is_rejected_with_its_line():
    text = DEMO.read_text(encoding="utf-8") + "name: other\n"
    line = text.count("\n")
    with pytest.raises(SpecError, match=rf"^x.yaml: not valid YAML at line {line}: duplicate key 'name'"):
        spec.load_text(text, source="x.yaml")


def test_a_changed_study_under_an_existing_name_is_refused(tmp_path):
    from service.core import storage
    from service.study.stored import check_same_study

    study = dataclasses.replace(spec.load_file(DEMO), storage=str(tmp_path))
    check_same_study(study)  # nothing stored yet
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    check_same_study(study)  # the same study: a rerun resumes it
    changed = dataclasses.replace(study, description="something else")
    expected = r"^name: study .digits-demo. already exists .* different description"
    with pytest.raises(SpecError, match=expected):
        check_same_study(changed)


def test_a_rerun_may_change_how_trials_run_but_not_what_they_compute(tmp_path):
    from service.core import storage
    from service.study.stored import check_same_study

    study = dataclasses.replace(spec.load_file(DEMO), storage=str(tmp_path))
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    first, *rest = study.rounds
    bigger = dataclasses.replace(
        study,
        rounds=(dataclasses.replace(first, max_concurrent_trials=64, trials_per_tune_run=7), *rest),
        input=dataclasses.replace(study.input, workers="processes", num_input_workers=3, cache_mb=0),
        tracking=dataclasses.replace(study.tracking, progress_interval_s=1.0),
    )
    check_same_study(bigger)  # resumes: same trials, run on more slots
    reseeded = dataclasses.replace(bigger, rounds=(dataclasses.replace(first, seed=first.seed + 1), *rest))
    with pytest.raises(SpecError, match=r"different rounds\[0\]\.seed; rerun it unchanged"):
        check_same_study(reseeded)
    longer = dataclasses.replace(study, training=dataclasses.replace(study.training, max_train_steps=7))
    with pytest.raises(SpecError, match=r"different training\.max_train_steps;"):
        check_same_study(longer)


def test_a_study_file_stored_by_the_earlier_version_still_loads():
    """Earlier versions stored every round field, with step_multiplier 2.0 on rounds that do not
    read it (and from_round: null); such a stored file loads as the same study."""
    text = DEMO.read_text(encoding="utf-8")
    s = spec.load_text(text)
    old = spec.to_dict(s)
    for r in old["rounds"]:
        r["step_multiplier"] = r["step_multiplier"] or 2.0
    old["rounds"].append({**old["rounds"][1], "name": "fixed-length", "max_train_steps": 900})
    loaded = spec.load_text(yaml.safe_dump(old))
    assert loaded.rounds[:2] == s.rounds
    assert (loaded.rounds[2].step_multiplier, loaded.rounds[2].max_train_steps) == (None, 900)
    # Written by hand (no from_round: null), the same fields are refused.
    raw = yaml.safe_load(text)
    raw["rounds"][0]["step_multiplier"] = 2.0
    with pytest.raises(SpecError, match=r"^rounds\[0\]\.step_multiplier: only applies to kind: extend"):
        spec.load_dict(raw)


def test_fsdp_layouts_that_can_train_are_accepted(raw):
    raw["scaling"].update({"num_hosts": 2, "workers_per_host": 2, "strategy": "fsdp"})
    assert spec.load_dict(raw).scaling.resolved_shard_group_size == 4
    raw["scaling"]["shard_group_size"] = 2  # HSDP: shard within each host, replicate across them
    raw["training"]["precision"] = "bf16"
    assert spec.load_dict(raw).scaling.resolved_shard_group_size == 2
