# Two commands: `make demo` and `make test`. Each sets up the virtualenv it needs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup demo test test-fast test-cluster lint clean chromium prometheus bench bench-cluster bench-scale real-hosts chaos

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a CPU build on local disk; an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/playbook demo

# Unit, multi-process (gloo) and shared-Ray-cluster tests first; then the tests that start
# their own Ray head or simulated multi-node cluster, serially, each with a timeout.
test: setup
	$(MAKE) lint
	$(MAKE) test-fast
	$(MAKE) test-cluster

test-fast: setup chromium
	$(PYTEST) -q -m "not cluster" --timeout 900 --durations=25

test-cluster: setup prometheus
	$(PYTEST) -q -m cluster --timeout 900 --durations=0

# Headless Chromium for the report test: Debian's package, installed only when missing (CI runs as root).
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

# Debian's Prometheus for the dashboard test (deploy/grafana), installed only when missing.
prometheus:
	@test -x /usr/bin/prometheus || (apt-get update && apt-get install -y --no-install-recommends prometheus)

# Benchmarks against hand-written baselines, as ratios measured in the same run:
# bench/results.json and the generated performance table in docs/performance.md.
bench: setup
	$(PY) -m bench.run

# The long scale runs (the 15,000-trial coordinator-memory study, ~half an hour): `make bench`
# leaves them out and its tables show their last stored figures with the date they were measured.
bench-scale: setup
	$(PY) -m bench.run --only coordinator_memory

# Only the 1,000-trial study and the 4-node simulated cluster (issue 11), and a round of
# TWO_HOST_TRIALS two-host trials on a simulated 8-node cluster (issue 39; default 2,000:
# `make bench-cluster TWO_HOST_TRIALS=40` for a short one). Left out of `bench`, whose tables
# show their last stored figures with their date.
bench-cluster: setup
	$(PY) -m bench.run --only cluster

# A head and 3 worker hosts, each in its own network namespace with its own address (needs root
# and iproute2): a 2-trial study submitted with `ray job submit`, then all torn down.
real-hosts: setup
	$(PY) -m tests.helpers.real_hosts_demo

# A small study run RUNS times, one process drawn at random SIGKILLed at a random moment in
# each; every rerun must end bitwise equal to the uninterrupted reference (docs/reliability.md).
RUNS ?= 20
chaos: setup
	$(PY) -m tests.helpers.chaos --runs $(RUNS)

lint: setup
	$(VENV)/bin/ruff check service tests
	$(VENV)/bin/ruff format --check service tests

clean:
	rm -rf .demo playbook-studies
