"""Shared fixtures: the digits parquet data, one Ray cluster per test session, a GCS emulator.
Plain functions and constants the tests share live in tests/helpers/."""

from __future__ import annotations

import os

import pytest

from service.data.builtin import write_digits

# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default:
# 2 s), and a worker's report waits for that poll once the one before it is still unread: every
# evaluation of a multi-worker trial cost up to 2 s of idle time. Set here, in the environment of
# this process, every Ray node, driver and `playbook` process the tests start (docs/partitions.md).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_digits(str(root))
    return root


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs Ray."""
    import ray

    from service.orchestration.coordinator import NAMESPACE

    ray.init(
        address="local",  # a new cluster, never one that another process started on this machine
        num_cpus=2,
        namespace=NAMESPACE,
        include_dashboard=False,
        # Not forwarded to pytest's stderr: an earlier test's actor could print into a later
        # test's captured output. A command's own output is what its tests compare.
        log_to_driver=False,
        # Metrics exported every second (Ray: 10): a `playbook run` on this cluster waits for
        # its study's last values to be exported (`run_study`'s settle_metrics).
        _system_config={"metrics_report_interval_ms": 1000},
        runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """gs://<bucket> on a gcp-storage-emulator on loopback (see tests/helpers/gcs.py)."""
    from tests.helpers.gcs import emulated_bucket

    yield from emulated_bucket(str(tmp_path_factory.mktemp("gcs")))
