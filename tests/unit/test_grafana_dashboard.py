"""deploy/grafana/playbook-study.json imports as is (every query on the dashboard's datasource
variable, unique panel ids, the study / round / trial variables listed from series), and asks
only for series the coordinator publishes (`orchestration.study_metrics`), with the labels they
carry. Its queries run against a real Prometheus in tests/cluster/test_grafana_prometheus.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from service.orchestration.study_metrics import DESCRIPTIONS
from service.tracking.live_metrics import ROUND_SERIES, TRIAL_EXPOSED, TRIAL_SERIES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "playbook-study.json"
PROMTOOL = "/usr/bin/promtool"  # with Debian's prometheus (`make prometheus`)
SELECTOR = re.compile(r"ray_playbook_(\w+)\{([^}]*)\}")


def labels_of(name: str) -> set[str]:
    if name in ROUND_SERIES:
        return {"study", "round"}
    if name in (*TRIAL_SERIES, TRIAL_EXPOSED):
        return {"study", "round", "trial"}
    return {"study"}


def test_the_dashboard_imports_as_is():
    d = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("study", "round", "trial"):
        assert variables[name]["type"] == "query"
        assert re.fullmatch(
            rf"label_values\(ray_playbook_\w+(\{{.*\}})?, {name}\)", variables[name]["query"]["query"]
        )
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def test_every_query_asks_for_published_series_by_their_labels():
    d = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in d["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    for q in queries:
        for name, selector in SELECTOR.findall(q) or [(m, "") for m in re.findall(r"ray_playbook_(\w+)", q)]:
            assert name in DESCRIPTIONS, (name, q)
            used = set(re.findall(r"(\w+)=~?", selector))
            assert used <= labels_of(name), (name, used)
            grouped = re.findall(r"by \(([^)]*)\)", q)
            assert all(set(g.replace(" ", "").split(",")) <= labels_of(name) for g in grouped), q


@pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="promtool comes with `make prometheus`")
def test_promtool_accepts_the_queries_and_the_prometheus_config(tmp_path):
    d = json.loads(DASHBOARD.read_text())
    exprs = sorted({t["expr"] for p in d["panels"] for t in p["targets"]})
    filled = [e.replace("$study", "s").replace("$round", "r").replace("$trial", ".*") for e in exprs]
    rules = {
        "groups": [
            {"name": "panels", "rules": [{"record": f"panel:{i}", "expr": e} for i, e in enumerate(filled)]}
        ]
    }
    (path := tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    out = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"{len(filled)} rules found" in out.stdout, out.stdout + out.stderr
    config = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
