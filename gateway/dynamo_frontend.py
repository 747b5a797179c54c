"""NVIDIA Dynamo's frontend (``python -m dynamo.frontend``), the router in front of a ``dynamo-vllm``
deployment's workers.

``DynamoFrontend(discovery_dir, ...)`` describes one process: OpenAI HTTP on ``host:port``,
workers found by ``discovery_backend`` (``file`` or ``kubernetes``), request plane ``tcp``
(answers back to ``address``), event plane ``zmq`` (through ``event_broker`` when given),
``router_mode`` (``least-loaded``, or ``kv``), session affinity for ``X-Dynamo-Session-ID``.
``start()`` returns once ``/v1/models`` answers; ``wait_model(name)`` once a worker of ``name``
registered; ``stop()`` escalates SIGTERM to SIGKILL of its process group. With ``tls`` it
serves HTTPS only to holders of the stack's client certificate.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from common.dynamo_planes import discovery_problem, plane_args, plane_env
from common.dynamo_tls import DynamoTls
from common.processes import free_port, terminate, wait_serving

FRONTEND_MODULE = "dynamo.frontend"


class DynamoFrontendError(RuntimeError):
    pass


class DynamoFrontend:
    """One Dynamo frontend process (module docstring)."""

    def __init__(
        self,
        discovery_dir: Path | str,
        *,
        log_path: Path | str,
        namespace: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        router_mode: str = "least-loaded",
        session_ttl_s: int = 600,
        python: str = sys.executable,
        discovery_backend: str = "file",
        address: str | None = None,
        tls: DynamoTls | None = None,
        event_broker: str | None = None,
    ) -> None:
        self.discovery_dir = Path(discovery_dir)
        self.event_broker = event_broker
        self.tls = tls
        self.discovery_backend = discovery_backend
        self.address = address or host
        self.log_path = Path(log_path)
        self.namespace = namespace
        self.host = host
        self.port = port
        self.router_mode = router_mode
        self.session_ttl_s = session_ttl_s
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise DynamoFrontendError("the Dynamo frontend is not started")
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", FRONTEND_MODULE,
            "--http-host", self.host, "--http-port", str(self.port),
            *plane_args(self.discovery_backend),
            "--router-mode", self.router_mode,
            "--router-session-affinity-ttl-secs", str(self.session_ttl_s),
        ]  # fmt: skip
        if self.namespace:
            cmd += ["--namespace", self.namespace]
        if self.tls:
            cmd += self.tls.frontend_args()
        return cmd

    def environment(self) -> dict[str, str]:
        env = plane_env(self.discovery_backend, self.discovery_dir, os.environ, self.event_broker)
        env.update(
            {
                "DYN_TCP_RESPONSE_STREAM_HOST": self.address,
                "DYN_EVENT_PLANE_HOST": self.address,
                "DYN_TCP_RPC_HOST": self.address,
                "HF_HUB_OFFLINE": "1",
            }
        )
        return env

    async def start(self, timeout: float = 120.0) -> DynamoFrontend:
        if self._proc is not None:
            raise DynamoFrontendError("already started")
        if problem := discovery_problem(self.discovery_backend, self.discovery_dir):
            raise DynamoFrontendError(problem)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(self.host)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
            )
        try:
            await self._wait(lambda models: True, timeout, "answering")
        except BaseException:
            await self.stop()
            raise
        return self

    async def models(self) -> list[str]:
        async with httpx.AsyncClient(timeout=5.0, verify=self.tls.ssl_context() if self.tls else True) as client:
            resp = await client.get(self.url + "/v1/models")
            resp.raise_for_status()
            return [m["id"] for m in resp.json().get("data", [])]

    async def wait_model(self, name: str, timeout: float = 120.0) -> None:
        await self._wait(lambda models: name in models, timeout, f"serving {name!r}")

    async def _wait(self, ok, timeout: float, what: str) -> None:
        async def serving() -> bool:
            return ok(await self.models())

        await wait_serving(
            self._proc,
            serving,
            name="the Dynamo frontend",
            url=self.url,
            log_path=self.log_path,
            timeout=timeout,
            error=DynamoFrontendError,
            ready=what,
            not_yet=(httpx.HTTPError, ValueError),
            every=0.25,
        )

    async def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        await terminate(proc, timeout, every=0.1)
