"""A rollouts control plane and node agents on network-namespace hosts (tests/multihost/hosts.py):
what the multi-host scenarios (test_cluster_scenarios.py) and bench/multihost_hot_load.py start.

- `start_control_plane(host, node_slots)`: `rollouts up --host ADDRESS --node-slots N` in that
  host (its own node agent, named `local`); returns its home's settings (``Settings.own``: a
  sourced stack.env in the runner's shell does not redirect them), every URL naming the host's
  address.
- `start_node(host, settings, slots)`: `rollouts node` in that host, configured from the
  environment alone, as a cluster install does (`node_env`).
- `registry_nodes(settings)`: the node registry's memo (node name -> record).
- `stop_control_plane(host, settings)`: `rollouts down` there.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from common.settings import Settings, temporal_client
from contracts import names
from tests.multihost.hosts import Host
from workers.stack import LOCAL_NODE

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = [sys.executable, "-m", "workers.cli"]


def node_env(settings: Settings, home: Path) -> dict[str, str]:
    """What a cluster install gives every node agent: the control plane's addresses and keys."""
    return {
        "ROLLOUTS_HOME": str(home),
        "TEMPORAL_ADDRESS": settings.temporal_address,
        "TEMPORAL_NAMESPACE": settings.temporal_namespace,
        "AWS_ENDPOINT_URL_S3": settings.s3_endpoint,
        "AWS_ACCESS_KEY_ID": settings.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": settings.s3_secret_key,
        "AWS_REGION": settings.s3_region,
        "ROLLOUTS_ENGINE_KEY": settings.engine_key,
        "ROLLOUTS_ZONE": settings.zone,
        # Dynamo's file discovery: the control plane's directory, which every host here shares
        # (a cluster shares it on a network filesystem, or uses Kubernetes discovery).
        "ROLLOUTS_DYNAMO_DISCOVERY_DIR": str(settings.dynamo_discovery_dir),
        # The stack's Dynamo TLS certificates (a cluster copies them to every node).
        "ROLLOUTS_DYNAMO_TLS_DIR": str(settings.dynamo_tls_dir),
        # The control plane's relay of Dynamo's event plane (gateway/dynamo_events.py).
        "ROLLOUTS_DYNAMO_EVENT_BROKER": settings.dynamo_event_broker or "",
    }


def stack_home(host: Host) -> Path:
    return host.home / "stack"


def node_home(host: Host) -> Path:
    return host.home / "node"


def start_control_plane(host: Host, node_slots: int) -> Settings:
    up = host.run(
        [*ROLLOUTS, "--home", stack_home(host), "up", "--host", host.address, "--node-slots", str(node_slots)],
        timeout=600,
        cwd=REPO,
    )
    if up.returncode != 0:
        raise RuntimeError(f"rollouts up in {host.name} failed:\n{up.stdout}\n{up.stderr}")
    settings = Settings.own(stack_home(host))
    assert settings.api_url.startswith(f"http://{host.address}:"), settings.api_url
    return settings


def stop_control_plane(host: Host) -> None:
    host.run([*ROLLOUTS, "--home", stack_home(host), "down"], timeout=180, cwd=REPO)


def start_node(host: Host, settings: Settings, slots: int) -> None:
    host.spawn(
        [*ROLLOUTS, "node", "--name", host.name, "--address", host.address, "--slots", str(slots)],
        env=node_env(settings, node_home(host)),
        cwd=REPO,
    )


def registry_nodes(settings: Settings) -> dict:
    async def read() -> dict:
        client = await temporal_client(settings)
        desc = await client.get_workflow_handle(names.NODE_REGISTRY_ID).describe()
        return (await desc.memo()).get("nodes", {})

    return asyncio.run(read())


def wait_nodes(settings: Settings, expected: list[str], timeout: float = 120) -> None:
    """Until exactly `expected` nodes are registered and up."""
    deadline = time.monotonic() + timeout
    while True:
        up = sorted(n for n, r in registry_nodes(settings).items() if not r.get("lost"))
        if up == sorted(expected):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes up {up}, expected {sorted(expected)} within {timeout:.0f}s")
        time.sleep(1)


__all__ = [
    "LOCAL_NODE",
    "REPO",
    "ROLLOUTS",
    "node_env",
    "node_home",
    "registry_nodes",
    "stack_home",
    "start_control_plane",
    "start_node",
    "stop_control_plane",
    "wait_nodes",
]
