"""`rollouts dynamo-frontend` (a cluster install's Dynamo frontend) and the frontend's settings:
the discovery backend and the address workers answer to come from the settings; an address no
worker can reach is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.settings import Settings
from gateway.dynamo_frontend import DynamoFrontend


def run_frontend(home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``rollouts dynamo-frontend --home home`` in a child process with exactly ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "dynamo-frontend", "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def without(*prefixes: str) -> dict[str, str]:
    """This process's environment without the variables whose names start with ``prefixes``."""
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def test_kubernetes_discovery_needs_no_directory_and_advertises_the_pod_address(tmp_path: Path) -> None:
    frontend = DynamoFrontend(
        tmp_path / "discovery",
        log_path=tmp_path / "f.log",
        host="0.0.0.0",
        port=8000,
        discovery_backend="kubernetes",
        address="10.1.2.3",
    )
    command, env = frontend.command(), frontend.environment()
    assert command[command.index("--discovery-backend") + 1] == "kubernetes"
    assert command[command.index("--http-host") + 1] == "0.0.0.0"
    assert env["DYN_DISCOVERY_BACKEND"] == "kubernetes" and "DYN_FILE_KV" not in env
    assert env["DYN_TCP_RESPONSE_STREAM_HOST"] == env["DYN_EVENT_PLANE_HOST"] == "10.1.2.3"
    local = DynamoFrontend(tmp_path / "discovery", log_path=tmp_path / "f.log", port=8000)
    assert local.environment()["DYN_FILE_KV"] == str(tmp_path / "discovery")
    assert local.environment()["DYN_TCP_RESPONSE_STREAM_HOST"] == "127.0.0.1"


def test_an_unreachable_address_is_refused(tmp_path: Path) -> None:
    Settings.create(tmp_path, host="0.0.0.0").save()
    env = without("ROLLOUTS_", "TEMPORAL_")
    proc = run_frontend(tmp_path, env)
    assert proc.returncode == 2
    assert "--address 0.0.0.0 is not one workers can reach" in proc.stderr


def test_kubernetes_discovery_without_the_pod_variables_is_refused(tmp_path: Path) -> None:
    Settings.create(tmp_path).save()
    env = without("ROLLOUTS_", "TEMPORAL_", "POD_")
    env.update(ROLLOUTS_DYNAMO_DISCOVERY="kubernetes", POD_NAME="frontend-0")
    proc = run_frontend(tmp_path, env)
    assert proc.returncode == 2
    assert "POD_NAMESPACE, POD_UID are not set" in proc.stderr and "downward API" in proc.stderr


def test_a_cluster_frontend_needs_no_keys(tmp_path: Path) -> None:
    # No stack.json, a cluster's environment without S3 or engine keys: it gets as far as its own
    # checks (here: the unreachable address), not "ROLLOUTS_ENGINE_KEY is not set".
    env = without("ROLLOUTS_", "TEMPORAL_", "AWS_", "POD_")
    env.update(TEMPORAL_ADDRESS="temporal.example:7233", ROLLOUTS_HOST="0.0.0.0", ROLLOUTS_DYNAMO_PORT="8000")
    proc = run_frontend(tmp_path, env)
    assert proc.returncode == 2 and "--address 0.0.0.0 is not one workers can reach" in proc.stderr, proc.stderr
