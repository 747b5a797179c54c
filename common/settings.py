"""Settings every rollouts process reads: where Temporal, the S3 store and the tokens are.

Sources: the embedded stack's ``$ROLLOUTS_HOME/stack.json``, or, when it is missing and
``TEMPORAL_ADDRESS`` is set, the environment alone (:meth:`Settings.from_env`; a missing required
variable is a SystemExit naming each). Invariants: for a client (:meth:`Settings.load`) the
variables below override single values; the stack a home owns (:meth:`Settings.own`) takes none,
and its processes get :meth:`Settings.process_env`, without any variable that locates a stack
(:func:`without_stack_env`); every URL names :attr:`Settings.host` unless its own variable says
otherwise; nothing here contacts an address. docs/design.md "Nodes and placement"
(Settings); each variable: common/envs.py.

Variables read: ``ROLLOUTS_HOME``, ``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``,
``TEMPORAL_UI_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``ROLLOUTS_TOKENS_FILE``, ``ROLLOUTS_ENGINE_KEY``, ``ROLLOUTS_API_URL``,
``ROLLOUTS_GATEWAY_URL``, ``ROLLOUTS_HOST``, ``ROLLOUTS_API_PORT``, ``ROLLOUTS_GATEWAY_PORT``,
``ROLLOUTS_WORKER_METRICS_PORT``, ``ROLLOUTS_REPLICA_METRICS_PORT``, ``ROLLOUTS_NODE_LOST_AFTER_S``,
``ROLLOUTS_DYNAMO_ROUTER_MODE``, ``ROLLOUTS_DYNAMO_FRONTEND_URL``, ``ROLLOUTS_DYNAMO_DISCOVERY``,
``ROLLOUTS_DYNAMO_DISCOVERY_DIR``, ``ROLLOUTS_DYNAMO_TLS_DIR``, ``ROLLOUTS_DYNAMO_EVENT_BROKER``,
``ROLLOUTS_BUCKET``, ``ROLLOUTS_ZONE``, ``ROLLOUTS_ORGANIZATION_ID``, ``ROLLOUTS_GATEWAY_ID``,
``ROLLOUTS_MODEL_NAME``, ``ROLLOUTS_BASE_MODEL_PATH`` (:data:`ENV_FIELDS`), and this process's
own two, read even for owned settings: ``ROLLOUTS_HOT_LOAD_ENGINES`` (:data:`HOT_LOAD_ENGINES_ENV`)
and ``ROLLOUTS_ENGINE_CACHE_DIR`` (:data:`ENGINE_CACHE_ENV`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from common import dynamo_tls, envs
from common.addresses import host_port
from common.dynamo_planes import broker_url
from common.dynamo_tls import DynamoTls

T = TypeVar("T")
DEFAULT_HOME = envs.ROLLOUTS_HOME.default
LOOPBACK = "127.0.0.1"
# The header that carries a replica engine's secret (replica/engine/guard.py checks it).
ENGINE_SECRET_HEADER = "x-rollouts-engine-secret"

# Offsets from the stack's port base. Replicas take free ports as they start.
PORT_OFFSETS = {
    "api": 0,
    "gateway": 1,
    "dynamo": 2,  # Dynamo's frontend (dynamo-vllm deployments)
    "worker_metrics": 3,  # the control worker's Prometheus endpoint (/metrics)
    "dynamo_events_in": 4,  # the relay of Dynamo's event plane: publishers connect here (XSUB)
    "dynamo_events_out": 5,  # ... and subscribers here (XPUB): gateway/dynamo_events.py
    "temporal": 10,
    "temporal_ui": 11,
    "temporal_http": 12,
    "temporal_metrics": 13,
    "s3": 20,
    "weed_master": 21,
    "weed_volume": 22,
    "weed_filer": 23,
    "weed_admin": 24,
}
DEFAULT_PORT_BASE = 17200

# The variables (common/envs.py) by the names other modules import.
HOST_ENV = envs.ROLLOUTS_HOST.name
HOT_LOAD_ENGINES_ENV = envs.ROLLOUTS_HOT_LOAD_ENGINES.name
ENGINE_CACHE_ENV = envs.ROLLOUTS_ENGINE_CACHE_DIR.name
# Ports a process may be told to listen on instead of its stack's.
PORT_VARS = {
    "api": envs.ROLLOUTS_API_PORT,
    "gateway": envs.ROLLOUTS_GATEWAY_PORT,
    "worker_metrics": envs.ROLLOUTS_WORKER_METRICS_PORT,
}
PORT_ENVS = {service: var.name for service, var in PORT_VARS.items()}
# Plain string fields any process takes from ROLLOUTS_<FIELD_UPPER> when set.
FIELD_VARS = {
    "bucket": envs.ROLLOUTS_BUCKET,
    "zone": envs.ROLLOUTS_ZONE,
    "organization_id": envs.ROLLOUTS_ORGANIZATION_ID,
    "gateway_id": envs.ROLLOUTS_GATEWAY_ID,
    "model_name": envs.ROLLOUTS_MODEL_NAME,
    "base_model_path": envs.ROLLOUTS_BASE_MODEL_PATH,
}
ENV_FIELDS = tuple(FIELD_VARS)
# What a cluster install (no stack.json) must set: Settings.from_env.
REQUIRED_ENV = (
    "TEMPORAL_ADDRESS",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    envs.ROLLOUTS_ENGINE_KEY.name,
)

# What locates a stack or names its parts (the variables common/envs.py marks ``stack``): what the
# settings read from the environment (all but ROLLOUTS_REPLICA_METRICS_PORT, a per-process port),
# what stack.env writes, and `rollouts dynamo-frontend`'s port and address. A process a stack starts
# gets none of them, nor any variable with a prefix of STACK_ENV_PREFIXES (without_stack_env): the
# temporal CLI, boto3 and cwtrain read those.
STACK_ENV = tuple(name for name, var in envs.TABLE.items() if var.stack)
STACK_ENV_PREFIXES = ("TEMPORAL_", "AWS_", "CW_")

# Search attributes the workflows set; registered when the dev server starts.
SEARCH_ATTRIBUTES = {
    "OrganizationId": "Keyword",
    "DeploymentId": "Keyword",
    "GatewayId": "Keyword",
    "HotLoadIdentity": "Keyword",
    "HotLoadState": "Keyword",
    "HotLoadType": "Keyword",
    "ResourceKind": "Keyword",
}


def home_from_env() -> Path:
    return envs.ROLLOUTS_HOME.get().absolute()


def without_stack_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without any variable that locates a stack (:data:`STACK_ENV`, and every name with a
    prefix of :data:`STACK_ENV_PREFIXES`); the rest (``PATH``, ``OTEL_*``, ``CUDA_VISIBLE_DEVICES``,
    ``ROLLOUTS_HOT_LOAD_ENGINES``, ``ROLLOUTS_ENGINE_CACHE_DIR``...) is kept."""
    return {k: v for k, v in env.items() if k not in STACK_ENV and not k.startswith(STACK_ENV_PREFIXES)}


def _or_exit(var: envs.Var[T], env: Mapping[str, str]) -> T:
    """``var``'s value in ``env``; SystemExit naming it when the value does not parse."""
    try:
        return var.get(env)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


@dataclass
class Settings:
    """Everything a rollouts process needs to find the rest of the stack."""

    home: str
    ports: dict[str, int]
    # What the embedded stack's services, the API and the gateway bind, and every URL below uses.
    host: str = LOOPBACK
    namespace: str = "default"
    bucket: str = "rollouts"
    base_model_path: str = "models/base"
    model_name: str = "rollouts-tiny-llama"
    organization_id: str = "org-local"
    gateway_id: str = "gw-local"
    zone: str = "LOCAL-1A"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_region: str = "LOCAL-1A"
    admin_token: str = ""
    viewer_token: str = ""
    # Keys every replica engine's secret (engine_secret); never leaves stack.json.
    engine_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    # Dynamo's router: "least-loaded", or "kv" (by prefix-cache overlap; workers publish KV events).
    dynamo_router_mode: str = "least-loaded"
    extra: dict[str, Any] = field(default_factory=dict)
    # The settings of the stack a home owns (Settings.own, Settings.create): the environment
    # overrides nothing. False: a client's (Settings.load, with_env), where it does. Never saved.
    owned: bool = field(default=False, repr=False, compare=False)

    # ------------------------------------------------------------------ derived
    @property
    def home_path(self) -> Path:
        return Path(self.home)

    @property
    def env(self) -> Mapping[str, str]:
        """The environment the values below may come from: none for :attr:`owned` settings, else
        this process's."""
        return {} if self.owned else os.environ

    def process_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process this stack starts: ``base`` (default this process's)
        without another stack's variables (:func:`without_stack_env`), ``ROLLOUTS_HOME`` this
        home; its :meth:`load` then reads this home's ``stack.json`` alone."""
        return {**without_stack_env(os.environ if base is None else base), envs.ROLLOUTS_HOME.name: self.home}

    @property
    def temporal_address(self) -> str:
        return self.env.get("TEMPORAL_ADDRESS") or host_port(self.host, self.ports["temporal"])

    @property
    def temporal_namespace(self) -> str:
        return self.env.get("TEMPORAL_NAMESPACE") or self.namespace

    @property
    def temporal_ui_url(self) -> str:
        return self.env.get("TEMPORAL_UI_URL") or f"http://{host_port(self.host, self.ports['temporal_ui'])}"

    @property
    def s3_endpoint(self) -> str:
        # An IP, not a name (`rollouts up --host` takes IPs only): boto3 then uses path-style
        # addressing, where a name makes it try bucket.NAME (docs/field-notes.md).
        return self.env.get("AWS_ENDPOINT_URL_S3") or f"http://{host_port(self.host, self.ports['s3'])}"

    @property
    def api_url(self) -> str:
        return envs.ROLLOUTS_API_URL.get(self.env) or f"http://{host_port(self.host, self.ports['api'])}"

    @property
    def gateway_url(self) -> str:
        return envs.ROLLOUTS_GATEWAY_URL.get(self.env) or f"http://{host_port(self.host, self.ports['gateway'])}"

    @property
    def dynamo_frontend_url(self) -> str:
        """Dynamo's frontend: where the gateway sends a dynamo-vllm deployment's requests (HTTPS
        when the stack's Dynamo TLS certificates exist: :meth:`dynamo_tls`)."""
        port = self.ports["dynamo"]
        scheme = "https" if self.dynamo_tls() is not None else "http"
        return envs.ROLLOUTS_DYNAMO_FRONTEND_URL.get(self.env) or f"{scheme}://{host_port(self.host, port)}"

    @property
    def dynamo_tls_dir(self) -> Path:
        """The stack's Dynamo TLS certificates (``common/dynamo_tls.py``): ``ROLLOUTS_DYNAMO_TLS_DIR``,
        default ``HOME/dynamo/tls``; a node agent of a cluster install is given the control
        plane's copy."""
        return envs.ROLLOUTS_DYNAMO_TLS_DIR.get(self.env) or self.home_path / "dynamo" / "tls"

    def dynamo_tls(self) -> DynamoTls | None:
        """The stack's Dynamo TLS certificates, or None where there are none (SystemExit naming
        the directory when some are missing)."""
        try:
            return dynamo_tls.load(self.dynamo_tls_dir)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None

    @property
    def dynamo_event_broker(self) -> str | None:
        """``DYN_ZMQ_BROKER_URL`` for every Dynamo process of this stack
        (``common.dynamo_planes``): ``ROLLOUTS_DYNAMO_EVENT_BROKER``; else, where the home holds
        a stack.json (the embedded stack, which runs the relay: gateway/dynamo_events.py), its
        relay on this host's ``dynamo_events_in`` / ``dynamo_events_out`` ports; else None
        (a cluster install without a relay: Dynamo's direct mode)."""
        if value := envs.ROLLOUTS_DYNAMO_EVENT_BROKER.get(self.env):
            return value
        if not (self.home_path / "stack.json").exists():
            return None
        return broker_url(self.host, self.ports["dynamo_events_in"], self.ports["dynamo_events_out"])

    @property
    def dynamo_discovery_backend(self) -> str:
        """Dynamo's discovery backend (``ROLLOUTS_DYNAMO_DISCOVERY``; default ``file``)."""
        return _or_exit(envs.ROLLOUTS_DYNAMO_DISCOVERY, self.env)

    @property
    def dynamo_discovery_dir(self) -> Path:
        """Dynamo's ``file`` discovery directory, shared by its frontend and every worker."""
        return envs.ROLLOUTS_DYNAMO_DISCOVERY_DIR.get(self.env) or self.home_path / "dynamo" / "discovery"

    @property
    def node_lost_after_s(self) -> float | None:
        """``ROLLOUTS_NODE_LOST_AFTER_S``: a positive number of seconds, or None when unset."""
        return envs.ROLLOUTS_NODE_LOST_AFTER_S.get(self.env)

    @property
    def replica_metrics_port(self) -> int:
        """The port of each replica agent's Prometheus endpoint (``ROLLOUTS_REPLICA_METRICS_PORT``;
        default 0: any free port, reported in the replica's ``metrics_url``)."""
        return _or_exit(envs.ROLLOUTS_REPLICA_METRICS_PORT, self.env) or 0

    @property
    def hot_load_engines(self) -> tuple[str, ...] | None:
        """The engines ``ROLLOUTS_HOT_LOAD_ENGINES`` names, or None when it is unset or blank; read
        from this process's environment whether or not the settings are :attr:`owned`."""
        return envs.ROLLOUTS_HOT_LOAD_ENGINES.get()

    @property
    def engine_cache_dir(self) -> Path:
        """``ROLLOUTS_ENGINE_CACHE_DIR`` when set (read from this process's environment whether or
        not the settings are :attr:`owned`), else ``HOME/engine-cache``."""
        return envs.ROLLOUTS_ENGINE_CACHE_DIR.get() or self.home_path / "engine-cache"

    @property
    def tokens_file(self) -> Path:
        return Path(envs.ROLLOUTS_TOKENS_FILE.get(self.env) or self.home_path / "tokens.json")

    def engine_secret(self, deployment_workflow_id: str, replica: str) -> str:
        """The secret of replica ``replica`` of the deployment whose workflow id is given: what
        its engine requires in ``ENGINE_SECRET_HEADER`` (module docstring)."""
        key = envs.ROLLOUTS_ENGINE_KEY.get(self.env) or self.engine_key
        if not key:
            raise ValueError("engine_key is empty: set it in stack.json or ROLLOUTS_ENGINE_KEY")
        message = f"{deployment_workflow_id}\n{replica}".encode()
        return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()

    def dynamo_request_secret(self, deployment_workflow_id: str) -> str:
        """The request-plane secret of every Dynamo worker of that deployment: what each inference
        request carries (``common.dynamo_planes.request_annotation``) and the worker checks."""
        return self.engine_secret(deployment_workflow_id, "\0dynamo-request-plane")

    def engine_headers(self, deployment_workflow_id: str, replica: str) -> dict[str, str]:
        """The header that lets a request through that replica's engine guard."""
        return {ENGINE_SECRET_HEADER: self.engine_secret(deployment_workflow_id, replica)}

    # ------------------------------------------------------------------ storage
    def save(self) -> None:
        path = self.home_path / "stack.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        data = asdict(self)
        del data["owned"]
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.chmod(tmp, 0o600)
        tmp.replace(path)

    @classmethod
    def load(cls, home: Path | None = None) -> Settings:
        """A client's settings of ``home`` (default: ``$ROLLOUTS_HOME``): its ``stack.json``, else,
        when ``TEMPORAL_ADDRESS`` is set, the environment alone (:meth:`from_env`); the
        environment's values override either (module docstring)."""
        home = (home or home_from_env()).absolute()
        path = home / "stack.json"
        if not path.exists() and os.environ.get("TEMPORAL_ADDRESS"):
            return cls.from_env(home)
        return cls._read(
            home, ", or set TEMPORAL_ADDRESS and the rest of a cluster install's environment (docs/operations.md)"
        ).with_env()

    @classmethod
    def own(cls, home: Path) -> Settings:
        """The settings of the stack ``home`` owns: its ``stack.json`` as written, the environment
        overriding nothing, now or when a value is read (module docstring)."""
        return cls._read(home.absolute())

    @classmethod
    def _read(cls, home: Path, missing_hint: str = "") -> Settings:
        """``home``'s ``stack.json``, :attr:`owned`; SystemExit naming the path when it is missing or
        was written before 0.1.0 (a port missing, a key no longer known)."""
        path = home / "stack.json"
        if not path.exists():
            raise SystemExit(
                f"no stack configuration at {path}: run `make up` (or `rollouts up --home {home}`) first{missing_hint}"
            )
        data = json.loads(path.read_text())
        data["home"] = str(home)
        data.pop("owned", None)
        missing = sorted(set(PORT_OFFSETS) - set(data.get("ports", {})))
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if missing or unknown:
            raise SystemExit(
                f"{path} was written before rollouts 0.1.0 (ports missing: "
                f"{', '.join(missing) or 'none'}; unknown keys: {', '.join(unknown) or 'none'}): stop "
                "its stack and remove that home (`make clean-data` for .rollouts), then `rollouts up` "
                "writes a new one"
            )
        return cls(**data, owned=True)

    @classmethod
    def from_env(cls, home: Path | None = None) -> Settings:
        """Settings from the environment alone (a cluster install: no ``stack.json``). Raises
        SystemExit naming every variable of :data:`REQUIRED_ENV` that is missing."""
        missing = [name for name in REQUIRED_ENV if not os.environ.get(name)]
        if missing:
            raise SystemExit(
                f"settings from the environment (no stack.json): {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set; a cluster install sets "
                f"{', '.join(REQUIRED_ENV)} for every rollouts process"
            )
        env = os.environ
        return cls(
            home=str((home or home_from_env()).absolute()),
            ports={name: DEFAULT_PORT_BASE + off for name, off in PORT_OFFSETS.items()},
            s3_access_key=env["AWS_ACCESS_KEY_ID"],
            s3_secret_key=env["AWS_SECRET_ACCESS_KEY"],
            s3_region=env.get("AWS_REGION") or "us-east-1",
            engine_key=env[envs.ROLLOUTS_ENGINE_KEY.name],
        ).with_env()

    def with_env(self) -> Settings:
        """These settings as a client's (not :attr:`owned`), with the environment's ``ROLLOUTS_HOST``,
        ``ROLLOUTS_API_PORT``, ``ROLLOUTS_GATEWAY_PORT`` and ``ROLLOUTS_<FIELD>`` (:data:`ENV_FIELDS`)
        applied; the other variables are read where they are used (the properties above)."""
        self.owned = False
        env = os.environ
        self.host = envs.ROLLOUTS_HOST.get(env) or self.host
        self.ports = dict(self.ports)
        for service, var in PORT_VARS.items():
            if port := _or_exit(var, env):
                self.ports[service] = port
        for name, field_var in FIELD_VARS.items():
            if value := field_var.get(env):
                setattr(self, name, value)
        self.dynamo_router_mode = envs.ROLLOUTS_DYNAMO_ROUTER_MODE.get(env) or self.dynamo_router_mode
        return self

    @classmethod
    def create(cls, home: Path, port_base: int = DEFAULT_PORT_BASE, host: str = LOOPBACK) -> Settings:
        """A new configuration with fresh credentials, :attr:`owned`; written once, reused by every `up`."""
        return cls(
            home=str(home.absolute()),
            ports={name: port_base + off for name, off in PORT_OFFSETS.items()},
            host=host,
            s3_access_key="rollouts" + secrets.token_hex(6),
            s3_secret_key=secrets.token_urlsafe(24),
            admin_token="rk-admin-" + secrets.token_urlsafe(24),
            viewer_token="rk-viewer-" + secrets.token_urlsafe(24),
            owned=True,
        )

    def s3_client(self) -> Any:
        """A boto3 client of the S3 store; for :attr:`owned` settings one whose session reads no
        ``AWS_*`` variable either (``AWS_PROFILE``, ``AWS_CA_BUNDLE``...: botocore's session
        variables with their environment names removed)."""
        import boto3  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included
        import botocore.session  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included
        from botocore.config import Config  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included

        no_env = {
            name: (config, None, default, convert)
            for name, (config, _, default, convert) in botocore.session.Session.SESSION_VARIABLES.items()
        }
        session = boto3.session.Session(
            botocore_session=botocore.session.Session(session_vars=no_env) if self.owned else None
        )
        return session.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID") or self.s3_access_key,
            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY") or self.s3_secret_key,
            region_name=self.env.get("AWS_REGION") or self.s3_region,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=32),
        )

    def stack_env(self) -> dict[str, str]:
        """The `KEY=value` lines of stack.env: what a trainer's shell needs (cwtrain, aws, boto3)."""
        return {
            envs.ROLLOUTS_HOME.name: self.home,
            envs.ROLLOUTS_API_URL.name: self.api_url,
            "CW_BASE_URL": self.api_url,
            "CW_API_TOKEN": self.admin_token,
            envs.ROLLOUTS_VIEWER_TOKEN.name: self.viewer_token,
            "AWS_ACCESS_KEY_ID": self.s3_access_key,
            "AWS_SECRET_ACCESS_KEY": self.s3_secret_key,
            "AWS_REGION": self.s3_region,
            "AWS_DEFAULT_REGION": self.s3_region,
            "CW_S3_ENDPOINT": self.s3_endpoint,
            "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
            envs.ROLLOUTS_BUCKET.name: self.bucket,
            envs.ROLLOUTS_BASE_MODEL_PATH.name: self.base_model_path,
            envs.ROLLOUTS_MODEL_NAME.name: self.model_name,
            envs.ROLLOUTS_GATEWAY_ID.name: self.gateway_id,
            envs.ROLLOUTS_GATEWAY_URL.name: self.gateway_url,
            "TEMPORAL_ADDRESS": self.temporal_address,
            "TEMPORAL_NAMESPACE": self.temporal_namespace,
            "TEMPORAL_UI_URL": self.temporal_ui_url,
            envs.ROLLOUTS_DYNAMO_FRONTEND_URL.name: self.dynamo_frontend_url,
        }


async def temporal_client(settings: Settings, **kwargs: Any) -> Any:
    """A Temporal client with the pydantic data converter (our wire objects are pydantic)."""
    from temporalio.client import Client  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included
    from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included
    from temporalio.service import KeepAliveConfig  # noqa: PLC0415 - boto3 and Temporal load only where used: settings are read in every process, vLLM's included

    # HTTP/2 pings find a connection a partition killed within 20 s, so a worker's poll is sent
    # again on a new connection once the link heals, not after the dead one's retransmits. Not
    # more often: the Temporal frontend closes connections that ping more than every 10 s
    # (keepAliveMinTime), failing their calls with "transport error".
    kwargs.setdefault("keep_alive_config", KeepAliveConfig(interval_millis=15_000, timeout_millis=5_000))
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
        **kwargs,
    )
