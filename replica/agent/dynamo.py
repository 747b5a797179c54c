"""A replica engine that is NVIDIA Dynamo's vLLM worker (``runtime.engine: dynamo-vllm``).

``DynamoEngineProcess`` is an `EngineProcess` whose process is
``python -m replica.engine.dynamo_worker``; everything the agent does with an engine works
unchanged on it. Control goes to the worker's system server (loopback only,
``POST /engine/rollouts/<name>``, secret in the body: ``DYNAMO_TRANSPORT``); inference goes
through the Dynamo frontend, pinned to this worker, carrying the deployment's request-plane
secret. Invariants: a paused worker leaves the routing pool unless it is the namespace's only
instance; a gated worker serves nothing until ``open_gate``; a held-out worker rejoins only on
``serve``; readiness requires the worker's own Dynamo id, so a foreign port is never taken for
it. The stop grace is ``STOP_GRACE_S`` unless the operator sets one. docs/design.md, "Dynamo", "Engine processes".
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx

from common import envs
from common.addresses import host_port
from common.dynamo_planes import DISCOVERY_BACKENDS, discovery_problem, plane_args, plane_env, request_annotation
from common.dynamo_tls import DynamoTls
from common.processes import free_port, free_port_below
from replica.agent.engine_process import EngineProcess, EngineStartError
from replica.agent.engine_rpc import DYNAMO_TRANSPORT, EngineRequestError
from replica.engine_routes import DYNAMO_PREFIX
from replica.launch import DYNAMO_WORKER_MODULE, REQUEST_SECRET_FILE_ENV

# Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number.
SYSTEM_PORT_MAX = 32767
# Dynamo's shutdown grace after the worker leaves discovery (module docstring, "Stop").
GRACE_ENV = "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"
STOP_GRACE_S = 1


class DynamoEngineProcess(EngineProcess):
    """A Dynamo vLLM worker for one model directory (module docstring)."""

    transport = DYNAMO_TRANSPORT

    def __init__(
        self,
        model_dir: Path | str,
        *,
        discovery_dir: Path | str,
        namespace: str,
        frontend_url: str | None = None,
        kv_events: bool = False,
        discovery_backend: str = "file",
        gated: bool = False,
        tls: DynamoTls | None = None,
        event_broker: str | None = None,
        request_secret: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model_dir, **options)
        # What every inference request must carry to the worker (default: a fresh random one).
        self.request_secret = request_secret or secrets.token_urlsafe(32)
        # The stack's relay of Dynamo's event plane (common.dynamo_planes), if it has one.
        self.event_broker = event_broker
        # The stack's Dynamo certificates: what this object reaches the frontend with.
        self.tls = tls
        # Start with the worker's gate closed: requests wait until `open_gate` (module docstring).
        self.gated = gated
        # Publish KV-cache events (ZMQ, on the node address) for Dynamo's KV-aware router.
        self.kv_events = kv_events
        self.kv_events_port: int | None = None
        if discovery_backend not in DISCOVERY_BACKENDS:
            raise ValueError(f"discovery_backend: {discovery_backend!r} is not one of {', '.join(DISCOVERY_BACKENDS)}")
        self.discovery_backend = discovery_backend
        self.discovery_dir = Path(discovery_dir)
        self.namespace = namespace
        self.frontend_url = frontend_url.rstrip("/") if frontend_url else None
        self.worker_id: int | None = None
        self.left = False
        # Out of the routing pool until `serve` (a joining replica): no swap puts it back.
        self.held_out = False

    @classmethod
    def attach(
        cls, base_url: str, *, worker_id: int | None = None, request_secret: str | None = None, **options: Any
    ) -> DynamoEngineProcess:
        """A running worker whose system server is at ``base_url`` (its control URL); with
        ``worker_id`` (its Dynamo id) and ``frontend_url``, ``/v1/...`` requests reach it.
        ``options``: `EngineProcess.attach`'s and this constructor's (``discovery_dir``,
        ``namespace``, ``frontend_url``, ``tls``)."""
        options.setdefault("discovery_dir", ".")
        options.setdefault("namespace", "")
        engine = super().attach(base_url, **options)
        assert isinstance(engine, DynamoEngineProcess)
        engine.worker_id = worker_id
        engine.request_secret = request_secret
        return engine

    @property
    def control_host(self) -> str:
        return "127.0.0.1"

    @property
    def public_url(self) -> str:
        """Other hosts reach a Dynamo worker only through the frontend; this is its control URL."""
        return self.base_url

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", DYNAMO_WORKER_MODULE,
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--enforce-eager",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--namespace", self.namespace,
            *plane_args(self.discovery_backend),
        ]  # fmt: skip
        if self.worker_extension_cls:
            cmd += ["--worker-extension-cls", self.worker_extension_cls]
        if self.kv_events:
            if self.kv_events_port is None:
                self.kv_events_port = free_port(self.node_address)
            cmd += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://{host_port(self.node_address, self.kv_events_port)}",
                    }
                ),
            ]
        return cmd + self.kv_cache_args() + self.extra_args

    def environment(self) -> dict[str, str]:
        env = plane_env(self.discovery_backend, self.discovery_dir, super().environment(), self.event_broker)
        env.update(
            {
                "DYN_SYSTEM_HOST": self.control_host,
                "DYN_SYSTEM_PORT": str(self.port),
                "DYN_TCP_RPC_HOST": self.node_address,
                "DYN_EVENT_PLANE_HOST": self.node_address,
                # The response-stream server the worker opens as a request-plane client (its
                # `instances` route): else on the address the machine's hostname resolves to.
                "DYN_TCP_RESPONSE_STREAM_HOST": self.node_address,
            }
        )
        env.setdefault(GRACE_ENV, str(STOP_GRACE_S))
        if self.gated:
            env[envs.ROLLOUTS_GATED.name] = "1"
        env[REQUEST_SECRET_FILE_ENV] = str(self.request_secret_path)
        return env

    @property
    def request_secret_path(self) -> Path:
        return self.work_dir / "request.secret"

    def secret_files(self) -> dict[Path, str]:
        return {**super().secret_files(), self.request_secret_path: self.request_secret or ""}

    async def start(self, timeout: float = 600.0, on_spawn: Any = None) -> DynamoEngineProcess:
        if self.port is None:
            self.port = free_port_below(SYSTEM_PORT_MAX, self.control_host)
        if problem := discovery_problem(self.discovery_backend, self.discovery_dir):
            raise EngineStartError(problem)
        await super().start(timeout, on_spawn)
        return self

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Until the worker's /health says ready and it names its Dynamo worker id (kept)."""
        async with httpx.AsyncClient(timeout=5.0) as client:

            async def serving() -> bool:
                health = await client.get(self.base_url + "/health")
                if health.status_code != 200 or health.json().get("status") != "ready":
                    return False
                answer = (
                    await client.post(self.base_url + DYNAMO_PREFIX + "instance", json={"secret": self.secret})
                ).json()
                if not isinstance(answer.get("worker_id"), int):
                    return False
                self.worker_id = answer["worker_id"]
                return True

            await self._until_serving(serving, timeout, "the Dynamo worker", (httpx.HTTPError, ValueError))

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """An inference request (``/v1/...``) goes through the frontend to this worker alone."""
        if path.startswith("/v1/") and self.frontend_url:
            kwargs = self._to_this_worker(kwargs)
            async with httpx.AsyncClient(
                base_url=self.frontend_url,
                timeout=httpx.Timeout(600.0, connect=10.0),
                verify=self.tls.ssl_context() if self.tls else True,
            ) as c:
                resp = await c.request(method, path, **kwargs)
            if resp.status_code // 100 != 2:
                raise EngineRequestError(method, path, resp.status_code, resp.text)
            return resp
        return await super().request(method, path, **kwargs)

    def _to_this_worker(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A JSON body for Dynamo's frontend that only this worker serves
        (``nvext.backend_instance_id``), carrying the request-plane secret, with vLLM's top-level ``cache_salt`` where
        Dynamo reads it (``nvext.cache_salt``)."""
        body = kwargs.get("json")
        if not isinstance(body, dict) or self.worker_id is None:
            return kwargs
        body = dict(body)
        nvext = dict(body.get("nvext") or {})
        nvext.setdefault("backend_instance_id", self.worker_id)
        if self.request_secret:
            nvext["annotations"] = [*(nvext.get("annotations") or []), request_annotation(self.request_secret)]
        if "cache_salt" in body:
            nvext.setdefault("cache_salt", body.pop("cache_salt"))
        return {**kwargs, "json": {**body, "nvext": nvext}}

    async def instances(self) -> list[int]:
        """The Dynamo worker ids of every ``generate`` instance of the worker's namespace that
        Dynamo's discovery lists now (its own while it is in the pool)."""
        return list((await self.control("instances"))["worker_ids"])

    async def leave_pool(self) -> None:
        """Out of the frontend's routing pool when another instance of the namespace is in it."""
        others = [] if self.left else [w for w in await self.instances() if w != self.worker_id]
        if others:
            await self.control("leave")
            self.left = True

    async def rejoin_pool(self) -> None:
        if self.left and not self.held_out:
            await self.control("join")
            self.left = False

    @property
    def dynamo_worker(self) -> str:
        return "" if self.worker_id is None else f"{self.worker_id:x}"

    @property
    def dynamo_namespace(self) -> str:
        return self.namespace

    async def open_gate(self) -> None:
        """Let requests reach the engine (a worker started ``gated``)."""
        await self.control("open")

    async def hold_out(self) -> None:
        """Out of the frontend's routing pool, whatever else is in it, until `serve`."""
        self.held_out = True
        if not self.left:
            await self.control("leave")
            self.left = True

    async def serve(self) -> None:
        """Into the routing pool: the deployment made this replica a member."""
        self.held_out = False
        await self.rejoin_pool()

    async def models(self) -> list[str]:
        """The worker's model (its Dynamo name); for an attached worker told no name, what the
        frontend lists."""
        if self.served_model_name or not self.frontend_url:
            return [self.served_model_name]
        return await super().models()
