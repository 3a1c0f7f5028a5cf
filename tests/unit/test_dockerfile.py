"""docker/Dockerfile passes hadolint, and every version it pins (Ray base image, Python, torch)
is the one pyproject.toml pins."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def pyproject_pins() -> dict[str, str]:
    """{distribution name: version} of every `name==version` dependency in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for dep in project["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", dep.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def hadolint(path: Path) -> subprocess.CompletedProcess:
    # --no-color: plain lines; the default failure threshold (any finding fails) is kept.
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=120
    )


def test_dockerfile_passes_hadolint():
    out = hadolint(DOCKERFILE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_rejects_what_it_should(tmp_path):
    """The linter run above really checks: unpinned installs and a root user are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM rayproject/ray\nUSER root\nRUN pip install torch\n")
    out = hadolint(bad)
    assert out.returncode != 0
    for rule in ("DL3006", "DL3013", "DL3002"):  # untagged image, unpinned pip, last USER root
        assert rule in out.stdout, out.stdout


def test_dockerfile_pins_match_pyproject():
    text = DOCKERFILE.read_text()
    pins = pyproject_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    # The base image: rayproject/ray:<ray version>-py<python>, for the CPU default and the
    # GPU variant the header documents.
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_TAG\}$", text, re.M), "base image must come from RAY_TAG"
    tags = re.findall(r"RAY_TAG=(\S+)", text)
    assert len(tags) >= 2, tags
    python = re.search(r">=(\d+)\.(\d+)", project["requires-python"]).groups()
    expected = f"{pins['ray']}-py{''.join(python)}"
    assert sorted(set(tags)) == [expected, f"{expected}-gpu"]
    default = re.search(r"^ARG RAY_TAG=(\S+)$", text, re.M).group(1)
    assert default == expected

    # Every package the Dockerfile pins itself is pinned identically in pyproject.
    pinned = re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][^\s\"']*)", text)
    assert ("torch", pins["torch"]) in pinned
    for name, version in pinned:
        assert pins.get(name.lower()) == version, f"Dockerfile {name}=={version}, pyproject {pins.get(name)}"

    # The project itself is installed from its pyproject (so its pins apply), as a non-root user.
    assert re.search(r"pip install [^\n]*/home/ray/playbook\s*$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_no_secrets_in_the_image():
    """Only the project's own files go in (the context starts from nothing) and no variable
    carries credentials: the pods get them from workload identity."""
    text = DOCKERFILE.read_text()
    sources = {s for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M) for s in line.split()}
    assert sources == {"pyproject.toml", "README.md", "service", "studies"}
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert ignore[0] == "*"
    assert {line.removeprefix("!").rstrip("/") for line in ignore if line.startswith("!")} == sources
    assert not re.search(r"^ENV ", text, re.M)
    instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"CREDENTIALS|TOKEN|SECRET|PASSWORD|\.JSON", instructions.upper())
