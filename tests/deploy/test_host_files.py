"""deploy/systemd/ and deploy/docker/: the files a bare-host or image install uses.

- The systemd units pass ``systemd-analyze verify`` (offline; the installed path of `rollouts` in
  ExecStart is pointed at this checkout's venv, which is such an install), each runs `rollouts
  <its command>` as the unprivileged user with the shared environment file, and the node agent's
  unit keeps its replicas in its control group so stopping it stops them.
- The Dockerfile copies every package pyproject.toml installs, installs the ``cpu`` or ``gpu``
  extra by VARIANT, runs as a non-root user and has `rollouts` as its entry point. (No image is
  built here: there is no Docker daemon on these machines.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.helpers.deploy_files import DEPLOY, REPO

SYSTEMD = DEPLOY / "systemd"
INSTALLED_ROLLOUTS = "/opt/rollouts/bin/rollouts"
UNITS = {
    "rollouts-api.service": "api",
    "rollouts-worker.service": "worker",
    "rollouts-gateway.service": "gateway",
    "rollouts-node.service": "node",
    "rollouts-dynamo-frontend.service": "dynamo-frontend",
}


def test_there_is_one_unit_per_process_and_nothing_else():
    assert sorted(p.name for p in SYSTEMD.glob("*.service")) == sorted(UNITS)


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_unit_runs_its_command_unprivileged_from_the_environment_file(unit):
    text = (SYSTEMD / unit).read_text()
    assert f"ExecStart={INSTALLED_ROLLOUTS} {UNITS[unit]}\n" in text
    assert "User=rollouts\n" in text and "NoNewPrivileges=yes\n" in text and "CapabilityBoundingSet=\n" in text
    assert re.findall(r"^EnvironmentFile=(.*)$", text, re.MULTILINE)[0] == "/etc/rollouts/rollouts.env"
    # Each example the units read exists beside them.
    for path in re.findall(r"^EnvironmentFile=/etc/rollouts/(.*)$", text, re.MULTILINE):
        assert (SYSTEMD / f"{path}.example").is_file(), path


def test_stopping_the_node_agent_stops_its_replicas():
    text = (SYSTEMD / "rollouts-node.service").read_text()
    assert "KillMode=control-group\n" in text
    assert not re.search(r"^PrivateDevices=", text, re.MULTILINE)  # the engines need the GPUs' device files


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_the_units_verify(tmp_path):
    rollouts = REPO / ".venv" / "bin" / "rollouts"
    assert rollouts.exists(), f"{rollouts} missing: run `make install`"
    for unit in UNITS:
        (tmp_path / unit).write_text((SYSTEMD / unit).read_text().replace(INSTALLED_ROLLOUTS, str(rollouts)))
    done = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    # The premise: verify does read the files (a misspelt directive fails it).
    broken = tmp_path / "rollouts-api.service"
    broken.write_text(broken.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    done = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=120)
    assert "sometimes" in done.stderr


def test_the_image_installs_every_package_and_runs_rollouts_unprivileged():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.MULTILINE))
    assert copied == packages
    assert all((REPO / p).is_dir() for p in copied)
    assert '".[cpu]"' in dockerfile and '".[gpu]"' in dockerfile
    assert set(pyproject["project"]["optional-dependencies"]) >= {"cpu", "gpu"}
    assert re.search(r"^USER 10001:10001$", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["rollouts"]' in dockerfile
    # The Kubernetes pods run as that user.
    for path in (DEPLOY / "kubernetes" / "base").glob("*.yaml"):
        for uid in re.findall(r"runAsUser: (\d+)", path.read_text()):
            assert uid == "10001", path
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text()
    assert {f"!{p}" for p in packages} <= set(ignore.split())


def test_the_unit_paths_are_absolute_and_state_stays_in_its_directory():
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text()
        (home,) = re.findall(r"^Environment=ROLLOUTS_HOME=(.*)$", text, re.MULTILINE)
        (state,) = re.findall(r"^StateDirectory=(.*)$", text, re.MULTILINE)
        assert Path(home) == Path("/var/lib") / state, unit
