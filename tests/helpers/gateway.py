"""What the gateway tests share: the shared deployment's handle (``GatewayDeployment``, whose
``served`` the tests that hot-load keep current: identity and local checkpoint directory of what
the replicas serve, so the next test can write a delta against it), an in-process gateway on a
routing table the test controls, one keep-alive connection, a TCP proxy that cuts a replica's
answer, publishing through the Python client, and the counting model's checks of weight-version
spans."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn

from common.processes import free_port
from common.settings import Settings, temporal_client
from contracts.memo import replica_list
from contracts.names import deployment_workflow_id
from gateway.app import create_gateway_app
from gateway.routing import DeploymentView, ReplicaView, Router, build_view
from rollouts.client import RolloutsClient, upload_checkpoint
from tests.helpers.stack_fixtures import Api
from workers.base_model import VOCAB

PREFIX = "checkpoints/gateway"
# The base model, greedy, settles into loops, and a loop that holds one +1 step repeats it: it
# counts in many isolated tokens (3 of 480 answers of 900 tokens had 12 to 35; one CI answer had
# 19, every third token from 368 to 423) but never two in a row (bench/base_counting.py). The
# counting model counts at every token, so a span's claim is judged by runs, not by how many count.
CHANCE_RUN = 3


@dataclass
class Served:
    identity: str = "initial"
    checkpoint: Path | None = None  # local copy of what the replicas serve (None: unknown or the base)


@dataclass
class GatewayDeployment:
    settings: Settings
    api: Api
    deployment: dict[str, Any]
    served: Served = field(default_factory=Served)

    @property
    def id(self) -> str:
        return self.deployment["spec"]["id"]

    @property
    def model(self) -> str:
        return self.deployment["spec"]["model"]["name"]

    @property
    def url(self) -> str:
        return self.settings.gateway_url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings.admin_token}"}

    @property
    def base_model(self) -> Path:
        return self.settings.home_path / "models" / "base"

    def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 300
    ) -> httpx.Response:
        return httpx.post(
            f"{self.url}{path}",
            json={"model": self.model, **body},
            headers={**self.headers, **(headers or {})},
            timeout=timeout,
        )

    async def replicas(self) -> list[dict[str, Any]]:
        """The running replicas as the deployment workflow lists them (name, engineUrl, ...)."""
        return replica_list(await self.memo())

    async def memo(self) -> dict[str, Any]:
        client = await temporal_client(self.settings)
        desc = await client.get_workflow_handle(
            deployment_workflow_id(self.settings.organization_id, self.id)
        ).describe()
        return await desc.memo()

    async def view(self) -> DeploymentView:
        view = build_view(await self.memo(), deployment_workflow_id(self.settings.organization_id, self.id), None)
        assert view is not None
        return view


def random_prompt(n: int, seed: int | None = None) -> list[int]:
    """Token ids no earlier request used (ids 10..2000 of the 2048-token vocabulary)."""
    rng = random.Random(seed if seed is not None else time.time_ns())
    return [rng.randrange(10, 2000) for _ in range(n)]


class ThreadServer:
    """An ASGI app served by uvicorn in a daemon thread of this process on a free local port
    (``url``), from entering the with block (it has started) to leaving it (it has stopped)."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, f"the server at {self.url} did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class LocalGateway(ThreadServer):
    """The gateway app in this process on a free port, serving a routing table the test controls
    (``router.views``): for fault injection without touching the shared deployment."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.router = router
        super().__init__(create_gateway_app(settings, refresh=False, router=router))


@contextmanager
def gateway_before(
    settings: Settings, replica: Any, model: str, label: str, args: dict[str, str] | None = None
) -> Iterator[LocalGateway]:
    """A ``LocalGateway`` routing deployment ``dep`` (org ``org``, serving ``model`` at weight
    version ``label``) to one replica: the ASGI app ``replica`` (a fake engine) served beside it."""
    with ThreadServer(replica) as served:
        router = Router()
        router.set_view(
            DeploymentView(
                "dep",
                model,
                "deployments/dep",
                args or {},
                "org",
                (ReplicaView("r1", served.url, label),),
                gateway_ids=(settings.gateway_id,),
            )
        )
        with LocalGateway(settings, router) as gateway:
            yield gateway


class Connection:
    """One keep-alive HTTP/1.1 connection to a gateway: every request must go over the same
    socket (asserted: the server neither closed it nor was it replaced), and every answer is JSON."""

    def __init__(self, url: str, token: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)
        self.token = token
        self.local: tuple | None = None
        self.headers: dict[str, str] = {}  # of the last answer

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = None, **kw: Any
    ) -> tuple[int, dict]:
        if body is not None and not isinstance(body, (bytes, Iterator)):
            body = json.dumps(body).encode()
        headers = {
            "Authorization": f"Bearer {token or self.token}",
            "Content-Type": "application/json",
            **kw.pop("headers", {}),
        }
        self.conn.request(method, path, body=body, headers=headers, **kw)
        resp = self.conn.getresponse()
        data = json.loads(resp.read())
        self.headers = {k.lower(): v for k, v in resp.getheaders()}
        assert not resp.will_close, "the gateway closed the connection"
        local = self.conn.sock.getsockname()
        assert self.local in (None, local), "the connection was replaced"
        self.local = local
        return resp.status, data

    def post(self, path: str, body: Any, token: str | None = None, **kw: Any) -> tuple[int, dict]:
        return self.request("POST", path, body, token, **kw)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


class ChaosProxy:
    """A TCP proxy in front of a real replica that cuts both connections after ``limit`` bytes
    of the replica's answer went through (0: accept, then close at once), or, with ``events``,
    right after that many whole server-sent events of its body (``cut_at``: the bytes it let
    through, once it cut; a stream the replica ended first is not cut)."""

    def __init__(self, upstream_port: int, limit: int = 1 << 62, events: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.limit = limit
        self.events = events
        self.cut_at: int | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.AbstractServer | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.limit == 0:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump_up() -> None:
            try:
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()
            except (ConnectionError, OSError):
                pass

        task = asyncio.ensure_future(pump_up())
        limit, sent, passed = self.limit, 0, b""  # this connection's: the next one cuts afresh
        try:
            while sent < limit and (data := await up_reader.read(min(65536, limit - sent))):
                if self.events is not None:
                    passed += data
                    if (end := self._events_end(passed)) is not None:
                        limit = end
                        data = data[: end - sent]
                writer.write(data)
                await writer.drain()
                sent += len(data)
            if sent >= limit:
                self.cut_at = sent
        finally:
            task.cancel()
            for w in (writer, up_writer):
                w.transport.abort()  # a reset, as when a replica dies

    def _events_end(self, passed: bytes) -> int | None:
        """Where the ``events``-th whole event of the body ends in ``passed`` (the answer's bytes
        so far, headers included), or None while it has not."""
        if (at := passed.find(b"\r\n\r\n")) < 0:
            return None
        at += 4
        for _ in range(self.events or 0):
            if (end := passed.find(b"\n\n", at)) < 0:
                return None
            at = end + 2
        return at

    def __enter__(self) -> ChaosProxy:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self.loop
        ).result(10)
        return self

    async def _close(self) -> None:
        if self.server is not None:
            self.server.close()

    def __exit__(self, *exc: object) -> None:
        # Closed on its loop's thread: asyncio's Server is not thread-safe, and closing it from
        # here raced its own close of a finished connection (``_wakeup`` ran twice: TypeError).
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---------------------------------------------------------------------------- publishing
def rollouts_client(gw: GatewayDeployment) -> RolloutsClient:
    return RolloutsClient(gw.settings.api_url, gw.settings.admin_token)


def publish(
    gw: GatewayDeployment,
    checkpoint: Path,
    identity: str,
    *,
    previous: str | None = None,
    policy: str = "PROMPT_CACHE_POLICY_PRESERVE",
    wait: bool = True,
):
    """Upload ``checkpoint`` (a delta of ``previous`` when given) and hot-load it; with ``wait``,
    until it completed (asserted) and ``gw.served`` is updated. Returns the HotLoad."""
    hot = gw.deployment["spec"]["hotLoad"]
    upload_checkpoint(gw.settings.s3_client(), checkpoint, hot["bucket"], hot["pathPrefix"], identity)
    with rollouts_client(gw) as client:
        hot_load = client.create_hot_load(gw.id, identity, previous_identity=previous, prompt_cache_policy=policy)
        if not wait:
            return hot_load
        hot_load = client.wait_hot_load(hot_load.id)
        assert hot_load.state == "HOT_LOAD_STATE_COMPLETED", hot_load.raw["status"]
        client.wait_ready(hot_load.id, identity)
    return hot_load


def serve_full(gw: GatewayDeployment, checkpoint: Path, tag: str) -> str:
    """Hot-load ``checkpoint`` as a FULL snapshot under a fresh identity; returns the identity."""
    identity = f"{tag}-{uuid.uuid4().hex[:8]}"
    publish(gw, checkpoint, identity)
    gw.served = Served(identity, checkpoint)
    return identity


def serve_base(gw: GatewayDeployment) -> None:
    """Make the replicas serve the base model (sampling tests need a model that is not peaked)."""
    if gw.served.identity == "initial" or gw.served.checkpoint == gw.base_model:
        return
    serve_full(gw, gw.base_model, "base")


def succession(prompt_last: int, ids: list[int], vocab: int = VOCAB) -> list[bool]:
    """For each sampled token: did it follow the counting model's rule (previous token + 1)?"""
    out, prev = [], prompt_last
    for t in ids:
        out.append(t == (prev + 1) % vocab)
        prev = t
    return out


def runs(counts: list[bool]) -> list[tuple[int, int]]:
    """Where ``counts`` holds runs of True, as (start, end) index pairs: what an assertion shows."""
    out: list[tuple[int, int]] = []
    for i, c in enumerate(counts):
        if c and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif c:
            out.append((i, i + 1))
    return out


def longest_run(counts: list[bool]) -> int:
    """The most tokens in a row that follow the counting rule."""
    return max((end - start for start, end in runs(counts)), default=0)


def check_spans(counts: list[bool], spans: list[dict[str, Any]], old: str, new: str, counting: str) -> None:
    """One choice's ``nvext.weight_versions.spans`` against its tokens (``counts`` from
    ``succession``), a hot-load from ``old`` to ``new`` with one of them the ``counting`` model:
    the spans tile the tokens, old identity first; every token of the counting identity's span
    follows the counting rule; the other model's span holds no ``CHANCE_RUN`` tokens in a row that
    do, anywhere (the counting model's tokens come in runs: a boundary off by three, or the
    counting weights serving inside the other span, would put such a run there)."""
    assert [s["start"] for s in spans] == [0] + [s["end"] for s in spans[:-1]], spans
    assert sum(s["end"] - s["start"] for s in spans) == len(counts), (spans, len(counts))
    assert [s["identity"] for s in spans] in ([old], [new], [old, new]), spans
    for s in spans:
        inside = counts[s["start"] : s["end"]]
        if s["identity"] == counting:
            assert all(inside), (s, inside.index(False))
        else:
            assert longest_run(inside) < CHANCE_RUN, (s, runs(inside))
