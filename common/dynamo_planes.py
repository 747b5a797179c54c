"""How our NVIDIA Dynamo processes find each other: the frontend (gateway/dynamo_frontend.py) and
every worker (replica/agent/dynamo.py) run with the same discovery backend and planes.

Discovery (:data:`DISCOVERY_BACKENDS`): ``file`` (a shared directory, ``DYN_FILE_KV``) or
``kubernetes`` (a process known by its pod, :data:`POD_ENV`). Request plane ``tcp``, event plane
``zmq`` (through ``event_broker``, ``DYN_ZMQ_BROKER_URL``, when the stack has one); no etcd, no
NATS. ``plane_args`` / ``plane_env`` are one process's flags and environment;
``discovery_problem`` readies the backend or says why it cannot run. Invariant: every inference
request a worker serves carries its deployment's request-plane secret as a Dynamo annotation
(:func:`request_annotation`); the worker refuses any other. docs/design.md "Dynamo", "Security".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from common.addresses import host_port

DISCOVERY_BACKENDS = ("file", "kubernetes")
# What Dynamo's kubernetes discovery reads to know the pod a process runs in.
POD_ENV = ("POD_NAME", "POD_NAMESPACE", "POD_UID")
# The annotation that carries a request's request-plane secret (module docstring).
REQUEST_SECRET_PREFIX = "rollouts-request-secret:"


def request_annotation(secret: str) -> str:
    return REQUEST_SECRET_PREFIX + secret


def plane_args(backend: str) -> list[str]:
    return ["--discovery-backend", backend, "--request-plane", "tcp", "--event-plane", "zmq"]


def broker_url(host: str, inbound_port: int, outbound_port: int) -> str:
    """``DYN_ZMQ_BROKER_URL`` for a relay on ``host``: publishers to ``inbound`` (its XSUB),
    subscribers to ``outbound`` (its XPUB)."""
    return f"xsub=tcp://{host_port(host, inbound_port)} , xpub=tcp://{host_port(host, outbound_port)}"


def plane_env(
    backend: str, discovery_dir: Path, env: Mapping[str, str], event_broker: str | None = None
) -> dict[str, str]:
    """``env`` with the discovery backend and planes set (``DYN_FILE_KV`` only for ``file``,
    ``DYN_ZMQ_BROKER_URL`` only with ``event_broker``)."""
    out = {k: v for k, v in env.items() if k not in ("DYN_FILE_KV", "DYN_ZMQ_BROKER_URL")}
    if event_broker:
        out["DYN_ZMQ_BROKER_URL"] = event_broker
    out.update(
        {
            "DYN_DISCOVERY_BACKEND": backend,
            **({"DYN_FILE_KV": str(discovery_dir)} if backend == "file" else {}),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
        }
    )
    return out


def discovery_problem(backend: str, discovery_dir: Path) -> str | None:
    """Ready ``backend`` for a process about to start: ``file`` makes the directory; ``kubernetes``
    needs :data:`POD_ENV`. Returns why it cannot run, or None."""
    if backend == "file":
        discovery_dir.mkdir(parents=True, exist_ok=True)
        return None
    missing = [name for name in POD_ENV if not os.environ.get(name)]
    if not missing:
        return None
    return (
        f"Dynamo's kubernetes discovery needs {', '.join(POD_ENV)} from the downward API "
        f"(deploy/kubernetes/base/dynamo.yaml); {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
    )
