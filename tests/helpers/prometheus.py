"""Debian's `prometheus` started by a test on a config made from deploy/prometheus/prometheus.yml
(its own port, storage and scrape interval; Ray's service-discovery file of the test's head),
and its HTTP API: instant and range queries, label values."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.helpers.processes import free_ports

BINARY = "/usr/bin/prometheus"  # `make prometheus` installs Debian's package when it is missing
DEPLOYED_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml"


def config_for(ray_temp_dir: str, scrape_interval_s: int = 1) -> dict:
    """deploy/prometheus/prometheus.yml with the head's temp dir in place of /tmp/ray and a
    faster scrape (the test's Ray exports every second)."""
    config = yaml.safe_load(DEPLOYED_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = f"{scrape_interval_s}s"
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["files"] = [f.replace("/tmp/ray", ray_temp_dir, 1) for f in sd["files"]]
            sd["refresh_interval"] = f"{scrape_interval_s}s"
    return config


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector: [{metric: labels, value: [t, "v"]}]."""
        return self._get("/api/v1/query", query=expr, **({"time": at} if at else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """Range: [{metric: labels, values: [[t, "v"], ...]}]."""
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's `label_values(match, label)` lists."""
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def targets_up(self) -> list[str]:
        return [t["scrapeUrl"] for t in self._get("/api/v1/targets")["activeTargets"] if t["health"] == "up"]


@contextlib.contextmanager
def start_prometheus(tmp_path, ray_temp_dir: str):
    """Prometheus scraping the head whose temp dir is `ray_temp_dir`, until every node's
    endpoint in Ray's service-discovery file is up; ended by pid afterwards."""
    assert os.path.exists(BINARY), f"{BINARY} missing: `make prometheus` installs it"
    (config := tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config_for(ray_temp_dir)))
    (port,) = free_ports(1)
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            BINARY,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        wait_for_targets(prom, proc, ray_temp_dir, tmp_path / "prometheus.log")
        yield prom
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp_path / "tsdb", ignore_errors=True)


def wait_for_targets(prom: Prometheus, proc, ray_temp_dir: str, log_path, timeout_s: float = 60) -> None:
    sd_file = os.path.join(ray_temp_dir, "prom_metrics_service_discovery.json")
    deadline = time.time() + timeout_s
    while True:
        try:
            with open(sd_file) as f:
                wanted = {t for group in json.load(f) for t in group["targets"]}
            up = {u.split("//", 1)[1].split("/", 1)[0] for u in prom.targets_up()}
            if wanted and wanted <= up:
                return
        except (OSError, ValueError):
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"prometheus never scraped {sd_file}: {open(log_path).read()[-2000:]}")
        time.sleep(0.5)
