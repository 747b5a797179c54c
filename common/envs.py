"""Every ``ROLLOUTS_*`` environment variable the project reads, declared once: name, default,
parser and one line on what it does (:data:`TABLE`, in declaration order).

Invariants: a module reads its variable through its entry (``envs.ROLLOUTS_SHM_DIR.get()``),
never ``os.environ`` by name (rollouts/, the stand-alone client, excepted); :meth:`Var.get`
reads at call time (a hot path reads once and keeps the value); unset or blank is the default;
a value that does not parse is a ValueError naming variable and value; ``stack=True`` marks the
variables of ``common.settings.STACK_ENV``. docs/operations.md's table is :func:`markdown`
(``python -m common.envs``), kept in step by tests/common/test_envs.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from common.dynamo_planes import DISCOVERY_BACKENDS

T = TypeVar("T")
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Var(Generic[T]):
    """One variable: ``parse`` turns a set, non-blank value into the value; ``default`` is the value
    when it is unset or blank; ``shown`` the default as the docs state it, where the reader derives it."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    shown: str | None = None
    stack: bool = False

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The value in ``env`` (default: this process's environment)."""
        raw = (os.environ if env is None else env).get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r}: {exc}") from None


TABLE: dict[str, Var[Any]] = {}


def _declare(
    name: str, parse: Callable[[str], T], default: T, doc: str, *, shown: str | None = None, stack: bool = False
) -> Var[T]:
    if name in TABLE or not name.startswith("ROLLOUTS_"):
        raise ValueError(f"{name}: declared twice, or not a ROLLOUTS_* name")
    TABLE[name] = var = Var(name, parse, default, doc, shown, stack)
    return var


# ------------------------------------------------------------------ parsers (ValueError: the reason)
def _parsed(kind: Callable[[str], N], value: str, what: str) -> N:
    """``kind(value)``; a value it cannot read is a ValueError saying it is not ``what``."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"not {what}") from None


def _int(value: str) -> int:
    return _parsed(int, value, "an integer")


def _port(value: str) -> int:
    port = _parsed(int, value, "a TCP port (1-65535)")
    if not 0 < port < 65536:
        raise ValueError("not a TCP port (1-65535)")
    return port


def _bytes(value: str) -> int:
    return _parsed(int, value, "a number of bytes")


def _seconds(value: str) -> float:
    seconds = _parsed(float, value, "a number of seconds")
    if not seconds > 0:
        raise ValueError("must be more than 0")
    return seconds


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return value

    return parse


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _path(value: str) -> Path:
    return Path(value.strip())


def _str(value: str) -> str:
    return value


# ------------------------------------------------------------------ where the stack is (stack=True)
ROLLOUTS_HOME = _declare(
    "ROLLOUTS_HOME",
    Path,
    Path(".rollouts"),
    "the stack's home (stack.json, tokens, logs)",
    shown="`./.rollouts`",
    stack=True,
)
ROLLOUTS_API_URL = _declare(
    "ROLLOUTS_API_URL", _str, None, "where the others reach the API", shown="http://HOST:port base", stack=True
)
ROLLOUTS_GATEWAY_URL = _declare(
    "ROLLOUTS_GATEWAY_URL",
    _str,
    None,
    "where the others reach the gateway",
    shown="http://HOST:port base + 1",
    stack=True,
)
ROLLOUTS_TOKENS_FILE = _declare(
    "ROLLOUTS_TOKENS_FILE", _str, None, "the API's and the gateway's tokens file", shown="HOME/tokens.json", stack=True
)
ROLLOUTS_ENGINE_KEY = _declare(
    "ROLLOUTS_ENGINE_KEY",
    _str,
    None,
    "keys every replica engine's secret; required, the same for every process, in a cluster install",
    shown="stack.json's engine_key",
    stack=True,
)
ROLLOUTS_VIEWER_TOKEN = _declare(
    "ROLLOUTS_VIEWER_TOKEN",
    _str,
    None,
    "the stack's viewer token, for a trainer's shell (stack.env writes it)",
    shown="stack.json's viewer_token",
    stack=True,
)
# ------------------------------------------------------------------ where a process listens
ROLLOUTS_HOST = _declare(
    "ROLLOUTS_HOST",
    _str,
    None,
    "the address the stack's services, the API and the gateway bind and advertise (`0.0.0.0` in a pod)",
    shown="stack.json's host, else 127.0.0.1",
    stack=True,
)
ROLLOUTS_API_PORT = _declare("ROLLOUTS_API_PORT", _port, None, "the API's port", shown="port base (17200)", stack=True)
ROLLOUTS_GATEWAY_PORT = _declare(
    "ROLLOUTS_GATEWAY_PORT", _port, None, "the gateway's port", shown="port base + 1", stack=True
)
ROLLOUTS_WORKER_METRICS_PORT = _declare(
    "ROLLOUTS_WORKER_METRICS_PORT",
    _port,
    None,
    "the control worker's Prometheus endpoint",
    shown="port base + 3",
    stack=True,
)
ROLLOUTS_REPLICA_METRICS_PORT = _declare(
    "ROLLOUTS_REPLICA_METRICS_PORT",
    _port,
    None,
    "each replica agent's Prometheus endpoint (its replica's metricsUrl)",
    shown="any free port",
)
# ------------------------------------------------------------------ names (Settings fields of the same name)
ROLLOUTS_BUCKET = _declare(
    "ROLLOUTS_BUCKET", _str, None, "the S3 bucket of snapshots and models", shown="`rollouts`", stack=True
)
ROLLOUTS_ZONE = _declare("ROLLOUTS_ZONE", _str, None, "the stack's zone", shown="`LOCAL-1A`", stack=True)
ROLLOUTS_ORGANIZATION_ID = _declare(
    "ROLLOUTS_ORGANIZATION_ID", _str, None, "the stack's organization", shown="`org-local`", stack=True
)
ROLLOUTS_GATEWAY_ID = _declare("ROLLOUTS_GATEWAY_ID", _str, None, "the gateway's id", shown="`gw-local`", stack=True)
ROLLOUTS_MODEL_NAME = _declare(
    "ROLLOUTS_MODEL_NAME", _str, None, "the served base model's name", shown="`rollouts-tiny-llama`", stack=True
)
ROLLOUTS_BASE_MODEL_PATH = _declare(
    "ROLLOUTS_BASE_MODEL_PATH", _str, None, "the base model's path in the bucket", shown="`models/base`", stack=True
)
# ------------------------------------------------------------------ NVIDIA Dynamo
ROLLOUTS_DYNAMO_ROUTER_MODE = _declare(
    "ROLLOUTS_DYNAMO_ROUTER_MODE",
    _str,
    None,
    "Dynamo's router: `least-loaded` or `kv` (by prefix-cache overlap)",
    shown="stack.json's, else `least-loaded`",
    stack=True,
)
ROLLOUTS_DYNAMO_FRONTEND_URL = _declare(
    "ROLLOUTS_DYNAMO_FRONTEND_URL",
    _str,
    None,
    "where the gateway reaches Dynamo's frontend",
    shown="HOST:port base + 2 (https with TLS certificates)",
    stack=True,
)
ROLLOUTS_DYNAMO_DISCOVERY = _declare(
    "ROLLOUTS_DYNAMO_DISCOVERY",
    _one_of(*DISCOVERY_BACKENDS),
    "file",
    "Dynamo's discovery backend: `file` or `kubernetes` (deploy/kubernetes/base/dynamo.yaml)",
    stack=True,
)
ROLLOUTS_DYNAMO_DISCOVERY_DIR = _declare(
    "ROLLOUTS_DYNAMO_DISCOVERY_DIR",
    _path,
    None,
    "the `file` discovery's directory, shared by the frontend and every worker",
    shown="HOME/dynamo/discovery",
    stack=True,
)
ROLLOUTS_DYNAMO_TLS_DIR = _declare(
    "ROLLOUTS_DYNAMO_TLS_DIR",
    _path,
    None,
    "the stack's Dynamo TLS certificates: the frontend serves HTTPS to the gateway "
    "alone when they exist; a multi-host install's node agents get a copy",
    shown="HOME/dynamo/tls",
    stack=True,
)
ROLLOUTS_DYNAMO_EVENT_BROKER = _declare(
    "ROLLOUTS_DYNAMO_EVENT_BROKER",
    _str,
    None,
    "`DYN_ZMQ_BROKER_URL` for every Dynamo process (the event plane's relay)",
    shown="the embedded stack's relay (port base + 4, + 5); else direct mode",
    stack=True,
)
ROLLOUTS_DYNAMO_PORT = _declare(
    "ROLLOUTS_DYNAMO_PORT", _int, None, "`rollouts dynamo-frontend`'s HTTP port", shown="port base + 2", stack=True
)
ROLLOUTS_DYNAMO_ADDRESS = _declare(
    "ROLLOUTS_DYNAMO_ADDRESS",
    _str,
    None,
    "`rollouts dynamo-frontend`: the address workers send answers back to",
    shown="the settings' host",
    stack=True,
)
# ------------------------------------------------------------------ the API and the control worker
ROLLOUTS_HOT_LOAD_ENGINES = _declare(
    "ROLLOUTS_HOT_LOAD_ENGINES",
    _names,
    None,
    "the API: engines whose deployments may hot-load, comma-separated",
    shown="`dynamo-vllm` (the guide's rule)",
)
ROLLOUTS_NODE_LOST_AFTER_S = _declare(
    "ROLLOUTS_NODE_LOST_AFTER_S",
    _seconds,
    None,
    "the control worker: seconds without a heartbeat before a node is lost",
    shown="30 (`contracts.nodes.LOST_AFTER_S`)",
)
# ------------------------------------------------------------------ the node agent (`rollouts node`)
ROLLOUTS_NODE_NAME = _declare("ROLLOUTS_NODE_NAME", _str, None, "the node's name (`--name`)", shown="the hostname")
ROLLOUTS_NODE_ADDRESS = _declare(
    "ROLLOUTS_NODE_ADDRESS",
    _str,
    None,
    "the node's address (`--address`); the agent gives it to each engine, whose peer broadcast binds it",
    shown="the stack's host",
)
ROLLOUTS_NODE_ZONE = _declare("ROLLOUTS_NODE_ZONE", _str, None, "the node's zone (`--zone`)", shown="the stack's zone")
ROLLOUTS_NODE_GPUS = _declare(
    "ROLLOUTS_NODE_GPUS", _int, None, "GPUs replicas may use (`--gpus`)", shown="the devices CUDA finds"
)
ROLLOUTS_NODE_SLOTS = _declare(
    "ROLLOUTS_NODE_SLOTS",
    _int,
    None,
    "replicas without GPUs the node runs (`--slots`)",
    shown="1 on a host without GPUs, else 0",
)
ROLLOUTS_ENGINE_BIND = _declare(
    "ROLLOUTS_ENGINE_BIND",
    _str,
    None,
    "the address the node's engines bind (`--engine-bind`)",
    shown="0.0.0.0; 127.0.0.1 when the node address is loopback",
)
ROLLOUTS_ENGINE_CACHE_DIR = _declare(
    "ROLLOUTS_ENGINE_CACHE_DIR",
    _path,
    None,
    "what the engines on a host share (vLLM's record of each model class); homes on one machine may share one",
    shown="HOME/engine-cache",
)
# ------------------------------------------------------------------ a replica and its engine
ROLLOUTS_PEER_BACKEND = _declare(
    "ROLLOUTS_PEER_BACKEND",
    _one_of("gloo", "nccl"),
    "gloo",
    "what an engine broadcasts to its peers over: `gloo` or `nccl` (GPU replicas; "
    "set it on every node agent of the deployment)",
)
ROLLOUTS_SCATTER_BUDGET_BYTES = _declare(
    "ROLLOUTS_SCATTER_BUDGET_BYTES", _bytes, 1 << 30, "device memory a GPU stage may hold", shown="1 GiB"
)
ROLLOUTS_PINNED_BUDGET_BYTES = _declare(
    "ROLLOUTS_PINNED_BUDGET_BYTES",
    _bytes,
    4 << 30,
    "pinned host memory for dense tensors past the scatter budget",
    shown="4 GiB",
)
ROLLOUTS_STAGE_KERNEL_BYTES = _declare(
    "ROLLOUTS_STAGE_KERNEL_BYTES",
    _bytes,
    4 << 30,
    "host memory a CPU stage may hold in kernel copies derived before the pause (0: derive in the pause)",
    shown="4 GiB",
)
ROLLOUTS_SHM_DIR = _declare(
    "ROLLOUTS_SHM_DIR",
    _path,
    None,
    "where the stage arenas' shared-memory files live",
    shown="/dev/shm, else the system's temp dir",
)
ROLLOUTS_JOB_DIR = _declare(
    "ROLLOUTS_JOB_DIR", _str, None, "where an engine's background jobs write results", shown="a per-process temp dir"
)
ROLLOUTS_CPU_KV_CACHE_BYTES = _declare(
    "ROLLOUTS_CPU_KV_CACHE_BYTES",
    _bytes,
    1 << 30,
    "CPU engines: their KV cache (vLLM's `--kv-cache-memory-bytes`), unless the deployment's "
    "engineConfig sets `kv-cache-memory-bytes`",
    shown="1 GiB",
)
ROLLOUTS_VLLM_SPIN_S = _declare(
    "ROLLOUTS_VLLM_SPIN_S", float, 0.05, "CPU engines: the cap on vLLM's idle busy-poll, in seconds"
)
ROLLOUTS_ENGINE_SECRET_FILE = _declare(
    "ROLLOUTS_ENGINE_SECRET_FILE", _str, None, "set by the agent: the 0600 file of its engine's secret"
)
ROLLOUTS_REQUEST_SECRET_FILE = _declare(
    "ROLLOUTS_REQUEST_SECRET_FILE", _str, None, "set by the agent: a Dynamo worker's request-plane secret file"
)
ROLLOUTS_GATED = _declare(
    "ROLLOUTS_GATED",
    lambda value: value == "1",
    False,
    "set by the agent: `1` starts a Dynamo worker with its gate closed",
    shown="unset",
)
# ------------------------------------------------------------------ operators and developers
ROLLOUTS_DEBUG = _declare(
    "ROLLOUTS_DEBUG", bool, False, "set: `rollouts` raises with a traceback, not one line", shown="unset"
)
ROLLOUTS_CWTRAIN_PYTHON = _declare(
    "ROLLOUTS_CWTRAIN_PYTHON", _str, None, "the benches' and tests' cwtrain Python", shown="`.venv-cw/bin/python`"
)


def markdown() -> str:
    """docs/operations.md's table of every variable, from :data:`TABLE`."""
    rows = ["| variable | default | inherited | |", "|---|---|---|---|"]
    for var in TABLE.values():
        default = var.shown or ("none" if var.default is None else f"`{var.default}`")
        rows.append(f"| `{var.name}` | {default} | {'no' if var.stack else 'yes'} | {var.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
