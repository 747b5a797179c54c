"""A control plane without vLLM: the real workflows and the real API on the real Temporal dev
server, with test activities registered under the real activity names.

`Fleet` runs, on one test's own task queue, the deployment, gateway and hot-load workflows plus
stand-ins for the control activities (`place_replicas` places every replica on one stand-in
node, whose queue `start_replicas` serves: it signals each replica ready at once;
`check_snapshot_files` runs the real check against a local directory tree standing in for
the bucket; the node registry itself is tested in tests/control/test_nodes.py) and, per replica, a worker on that
replica's own queue whose `apply_snapshot` the test scripts: succeed, fail with a snapshot error, or hold until released
(heartbeating, so a cancel reaches it). `Fleet.api` is the FastAPI app in process (httpx ASGI transport) on the same
Temporal client, so a test drives exactly what a trainer drives.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from api.app import PREFIX, create_app
from common.settings import Settings
from contracts import names
from contracts.activities import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    CheckSnapshotInput,
    CommitPeerStageInput,
    DrainInput,
    PeerOffer,
    PeerOfferInput,
    StageFromPeerInput,
    StageFromPeerResult,
    StartReplicasInput,
    StopReplicasInput,
)
from contracts.errors import FAILED_PRECONDITION, NON_RETRYABLE_SNAPSHOT, PEER_OFFER_REFUSED
from contracts.nodes import PlaceRequest, ReleaseRequest
from contracts.records import TERMINAL_HOT_LOAD_STATES, DeploymentInput, Placement, ReplicaEndpoint
from contracts.search import deployment_attributes
from contracts.tokens import add_token
from control.activities import check_snapshot
from control.deployment import DeploymentWorkflow
from control.gateway import GatewayWorkflow
from control.hot_load.group import StageGroupWorkflow
from control.hot_load.workflow import HotLoadWorkflow

ADMIN = "admin-token"
VIEWER = "viewer-token"
OTHER_ORG = "other-org-token"
DISABLED_ORG = "disabled-org-token"
ORG = "org-a"
ZONE = "LOCAL-1A"

ApplyBehaviour = Callable[[str, ApplySnapshotInput], Awaitable[None]]


def write_full(root: Path, identity: str, *, missing: tuple[str, ...] = ()) -> None:
    """A FULL snapshot's files (content irrelevant to admission; names and index matter)."""
    d = root / identity
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": "{}",
        "model.safetensors.index.json": json.dumps(
            {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
        ),
        "model-00001-of-00001.safetensors": "x",
    }
    for name, text in files.items():
        if name not in missing:
            (d / name).write_text(text)


def write_delta(root: Path, identity: str, base: str, *, missing: tuple[str, ...] = ()) -> None:
    d = root / identity
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "model.safetensors.index.json": json.dumps(
            {
                "metadata": {
                    "version": identity,
                    "base_version": base,
                    "delta_encoding": "xor",
                    "compression_format": "zstd",
                    "checksum_format": "adler32",
                },
                "weight_map": {"w": "model-00001-of-00001.safetensors"},
            }
        ),
        "model-00001-of-00001.safetensors": "x",
    }
    for name, text in files.items():
        if name not in missing:
            (d / name).write_text(text)


def replica_endpoint(name: str, task_queue: str, i: int = 0) -> ReplicaEndpoint:
    """How the fleet's ``i``-th replica ``name`` reports ready: its queue, a stand-in engine URL and pids."""
    return ReplicaEndpoint(
        name=name,
        zone=ZONE,
        task_queue=task_queue,
        engine_url="http://127.0.0.1:1",
        engine_pid=1000 + i,
        agent_pid=2000 + i,
        started_at="2026-01-01T00:00:00.000000Z",
    )


def fleet_node(task_queue: str) -> str:
    """The stand-in node every replica of a fleet is placed on (its own queue per fleet)."""
    return f"fleet-{task_queue}"


@dataclass
class Fleet:
    client: Client
    tmp: Path
    task_queue: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:12]}")
    replicas_per_deployment: int = 2
    # False: replicas never report ready, so deployments stay STATUS_CREATING.
    report_ready: bool = True
    # False: no control worker in this process (a durability test runs it as a process to kill).
    control_worker: bool = True
    # The API's request tracer (tests of tracing pass their own provider's).
    tracer: Any = None
    apply_delay: float = 0.05
    # name -> behaviour; default: succeed after `apply_delay`.
    apply_behaviour: dict[str, ApplyBehaviour] = field(default_factory=dict)
    applied: list[tuple[str, str]] = field(default_factory=list)
    # The replica names `stop_replicas` was asked to stop, in order.
    stopped: list[str] = field(default_factory=list)
    # The replica names whose `drain_replica` ran (scale-in), in order.
    drained: list[str] = field(default_factory=list)
    # The replica names placed and released (placement stand-ins), in order.
    placed: list[str] = field(default_factory=list)
    # Every `start_replicas` input, in order (what each start asked the node agent for).
    start_inputs: list[StartReplicasInput] = field(default_factory=list)
    # Set: `start_replicas` (the node agent's answer to a start or a check) fails with this
    # message, as a node agent that did not answer in time does to the deployment.
    node_silent: str | None = None
    released: list[str] = field(default_factory=list)
    # Set: `place_replicas` fails with this message as the registry does when capacity is short
    # (failed_precondition, not retried).
    place_error: str | None = None
    # name -> awaited before a broadcast stage reports success (raise to fail the stage).
    stage_behaviour: dict[str, Callable[[str], Awaitable[None]]] = field(default_factory=dict)
    # name -> awaited when a receiver swaps its broadcast stage in (raise to fail the swap).
    commit_behaviour: dict[str, Callable[[str], Awaitable[None]]] = field(default_factory=dict)
    # name -> awaited in an update from the bucket after its stage is ready, before the swap
    # (raise to fail the swap): the first replica's early offer answers in between.
    swap_behaviour: dict[str, Callable[[str], Awaitable[None]]] = field(default_factory=dict)
    # True: an early offer (`from_stage`) is refused, as by a replica without delta files.
    refuse_early_offer: bool = False
    # (replica, event) in the order the replicas' activities saw them: "applied", "offered"
    # (an early offer answered), "sent", "staged", "commit", "served", "drained", "stopped".
    peer_events: list[tuple[str, str]] = field(default_factory=list)
    hold: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.bucket_root = self.tmp / "bucket"
        self.bucket_root.mkdir(parents=True, exist_ok=True)
        self.settings = Settings.create(self.tmp / "home", 30000)
        self.settings.home_path.mkdir(parents=True, exist_ok=True)
        add_token(self.settings.tokens_file, ADMIN, "admin", ORG, "admin", buckets=["rollouts"])
        add_token(self.settings.tokens_file, VIEWER, "viewer", ORG, "viewer")
        add_token(self.settings.tokens_file, OTHER_ORG, "admin", "org-b", "other", buckets=["rollouts"])
        add_token(
            self.settings.tokens_file,
            DISABLED_ORG,
            "admin",
            "org-off",
            "off",
            hot_load_enabled=False,
            buckets=["rollouts"],
        )
        self._stack = AsyncExitStack()
        self._replica_workers: dict[str, Worker] = {}
        self._pool = ThreadPoolExecutor(max_workers=4)
        self.app = create_app(
            self.settings, temporal_client=self.client, task_queue=self.task_queue, tracer=self.tracer
        )

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Fleet:
        if self.control_worker:
            await self._stack.enter_async_context(
                Worker(
                    self.client,
                    task_queue=self.task_queue,
                    workflows=[DeploymentWorkflow, GatewayWorkflow, HotLoadWorkflow, StageGroupWorkflow],
                    activities=[self.place_replicas, self.release_replicas, self.check_snapshot_files],
                    activity_executor=self._pool,
                )
            )
        await self._stack.enter_async_context(
            Worker(
                self.client,
                task_queue=names.node_task_queue(self.node),
                activities=[self.start_replicas, self.stop_replicas],
                activity_executor=self._pool,
            )
        )
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        self.http = await self._stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=f"http://api{PREFIX}", timeout=60)
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.hold.set()
        await self._stack.aclose()
        for w in self._replica_workers.values():
            await w.shutdown()
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------ HTTP
    @asynccontextmanager
    async def other_api(self, task_queue: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
        """An admin's client of a second API process on the same Temporal (its own, empty caches),
        started; ``task_queue``: where it starts work (the fleet's by default)."""
        app = create_app(self.settings, temporal_client=self.client, task_queue=task_queue or self.task_queue)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url=f"http://api{PREFIX}",
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as http,
        ):
            yield http

    async def call(self, method: str, path: str, token: str = ADMIN, **kw: Any) -> httpx.Response:
        return await self.http.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kw)

    async def ready_deployment(
        self,
        name: str | None = None,
        *,
        hot_load: bool = True,
        replicas: int | None = None,
        token: str = ADMIN,
        wait: bool = True,
        autoscaling: dict[str, int] | None = None,
    ) -> str:
        """A gateway and a READY deployment (through the API, as `token`); returns the id."""
        gw = f"gw-{uuid.uuid4().hex[:6]}"
        r = await self.call("POST", "/gateways", token=token, json={"id": gw, "name": gw, "zones": [ZONE]})
        assert r.status_code == 200, r.text
        name = name or f"dep-{uuid.uuid4().hex[:6]}"
        body: dict[str, Any] = {
            "id": name,
            "name": name,
            "gatewayIds": [gw],
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
            "model": {"name": "m", "bucket": "rollouts", "path": "models/base"},
            "autoscaling": autoscaling
            or {"min": replicas or self.replicas_per_deployment, "max": replicas or self.replicas_per_deployment},
        }
        if hot_load:
            body["hotLoad"] = {"bucket": "rollouts", "pathPrefix": f"ckpt/{name}"}
        r = await self.call("POST", "/deployments", token=token, json=body)
        assert r.status_code == 200, r.text
        if wait:
            await self.wait_deployment(name, token=token)
        return name

    def replica_endpoints(self, dep_id: str, count: int) -> list[ReplicaEndpoint]:
        """`count` replicas with their workers running here, as a deployment would record them."""
        endpoints = []
        for i in range(count):
            name = f"replica-{i}"
            tq = f"{self.task_queue}/replica/{dep_id}/{name}"
            self._serve_replica(self.client, tq, name)
            endpoints.append(replica_endpoint(name, tq, i))
        return endpoints

    async def deployment_from_state(self, state: DeploymentInput) -> str:
        """A deployment workflow started from a given state (as after continue-as-new): how a
        test reaches states the API cannot make quickly (63 deltas, gateways in two zones)."""
        dep = state.deployment
        await self.client.start_workflow(
            DeploymentWorkflow.run,
            state,
            id=names.deployment_workflow_id(dep.spec.organization_id, dep.spec.id),
            task_queue=self.task_queue,
            search_attributes=deployment_attributes(dep.spec.organization_id, dep.spec.id),
            memo={"deployment": dep.wire(), "replicas": []},
        )
        return dep.spec.id

    async def wait_deployment(
        self, dep_id: str, status: str = "STATUS_READY", timeout: float = 90, token: str = ADMIN
    ) -> dict:
        async def check() -> dict | None:
            dep = (await self.call("GET", f"/deployments/{dep_id}", token=token)).json()["deployment"]
            return dep if dep["status"]["status"] == status else None

        return await poll(check, timeout, f"deployment {dep_id} {status}")

    async def create_hot_load(self, dep_id: str, identity: str, *, token: str = ADMIN, **body: Any) -> httpx.Response:
        return await self.call(
            "POST",
            "/hotLoads",
            token=token,
            json={"deploymentId": dep_id, "identity": identity, "type": "SNAPSHOT_TYPE_FULL", **body},
        )

    async def wait_hot_load(self, hl_id: str, timeout: float = 90) -> dict:
        async def check() -> dict | None:
            hl = (await self.call("GET", f"/hotLoads/{hl_id}")).json()["hotLoad"]
            return hl if hl["status"]["state"] in TERMINAL_HOT_LOAD_STATES else None

        return await poll(check, timeout, f"hot-load {hl_id} terminal")

    async def hot_load_replicas(self, hl_id: str) -> list[dict]:
        """``GET /hotLoads/{hl_id}/replicas``: the replica entries, in walk order."""
        return (await self.call("GET", f"/hotLoads/{hl_id}/replicas")).json()["replicas"]

    async def replica_outcomes(self, hl_id: str) -> list[tuple[str, str]]:
        """Each replica entry's ``(state, currentSnapshotIdentity)``, in walk order."""
        return [(r["state"], r["currentSnapshotIdentity"]) for r in await self.hot_load_replicas(hl_id)]

    async def wait_idle(self, dep_id: str, timeout: float = 90) -> None:
        """Until the deployment has taken note that its last hot-load ended."""

        async def check() -> bool | None:
            dep = (await self.call("GET", f"/deployments/{dep_id}")).json()["deployment"]
            return True if not dep["status"].get("activeHotLoadId") else None

        await poll(check, timeout, f"deployment {dep_id} idle")

    async def accepted(self, dep_id: str, identity: str, **body: Any) -> str:
        """Publish (files) + hot-load: the id of an accepted hot-load of `identity`."""
        if body.get("type") == "SNAPSHOT_TYPE_INCREMENTAL":
            write_delta(
                self.bucket_root / f"ckpt/{dep_id}",
                identity,
                body["incrementalSnapshotMetadata"]["previousSnapshotIdentity"],
            )
        else:
            write_full(self.bucket_root / f"ckpt/{dep_id}", identity)
        r = await self.create_hot_load(dep_id, identity, **body)
        assert r.status_code == 200, r.text
        return r.json()["hotLoad"]["spec"]["id"]

    async def completed(self, dep_id: str, identity: str, **body: Any) -> dict:
        """Publish (files) + hot-load + wait: a COMPLETED hot-load of `identity`."""
        hl = await self.wait_hot_load(await self.accepted(dep_id, identity, **body))
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl
        await self.wait_idle(dep_id)
        return hl

    # ------------------------------------------------------------------ replica processes
    def deployment_handle(self, dep_id: str):
        return self.client.get_workflow_handle(names.deployment_workflow_id(ORG, dep_id))

    async def deployment_state(self, dep_id: str) -> DeploymentInput:
        """The deployment workflow's own state (its `describe` query): members, pending, outdated."""
        return await self.deployment_handle(dep_id).query(DeploymentWorkflow.describe)

    async def lose(self, dep_id: str, *replicas: str) -> None:
        """These replicas' processes are gone, as after `rollouts down`: their workers stop, and
        the next `start_replicas` naming them starts them again (and reports it)."""
        for name in replicas:
            await self._replica_workers.pop(f"{self.task_queue}/replica/{dep_id}/{name}").shutdown()

    async def members_losing(self, dep_id: str, *indices: int) -> list[str]:
        """The deployment's members, of which those at ``indices`` are lost (``lose``); from now
        on a restarted replica reports ready only when the test says (``report_ready`` off)."""
        members = (await self.deployment_state(dep_id)).members
        self.report_ready = False
        await self.lose(dep_id, *(members[i] for i in indices))
        return members

    async def signal_ready(self, dep_id: str, name: str) -> None:
        """The replica `name` reports ready, as a (re)started replica does once it serves."""
        await self.deployment_handle(dep_id).signal(
            DeploymentWorkflow.replica_ready,
            replica_endpoint(name, f"{self.task_queue}/replica/{dep_id}/{name}"),
        )

    @property
    def node(self) -> str:
        return fleet_node(self.task_queue)

    # ------------------------------------------------------------------ control activities
    @activity.defn(name=names.PLACE_REPLICAS)
    async def place_replicas(self, req: PlaceRequest) -> dict[str, Placement]:
        if self.place_error is not None:
            raise ApplicationError(self.place_error, type=FAILED_PRECONDITION, non_retryable=True)
        self.placed.extend(req.replicas)
        return {name: Placement(node=self.node, address="127.0.0.1") for name in req.replicas}

    @activity.defn(name=names.RELEASE_REPLICAS)
    async def release_replicas(self, req: ReleaseRequest) -> int:
        self.released.extend(req.replicas)
        return len(req.replicas)

    # ------------------------------------------------------------------ the stand-in node agent
    @activity.defn(name=names.START_REPLICAS)
    async def start_replicas(self, inp: StartReplicasInput) -> list[str]:
        """Starts (once) a replica worker per name and reports it ready; returns the names started
        now (the deployment also calls this periodically to restart lost replicas: none here)."""
        self.start_inputs.append(inp)
        if self.node_silent is not None:
            raise ApplicationError(self.node_silent, non_retryable=True)
        handle = activity.client().get_workflow_handle(inp.deployment_workflow_id)
        started: list[str] = []
        for i, name in enumerate(inp.names):
            tq = f"{self.task_queue}/replica/{inp.deployment_id}/{name}"
            if tq in self._replica_workers:
                continue
            started.append(name)
            if tq not in self._replica_workers:
                self._serve_replica(activity.client(), tq, name)
            if not self.report_ready:
                continue
            await handle.signal(
                names.REPLICA_READY,
                replica_endpoint(name, tq, i),
            )
        return started

    @activity.defn(name=names.STOP_REPLICAS)
    async def stop_replicas(self, inp: StopReplicasInput) -> int:
        self.stopped.extend(inp.names)
        self.peer_events.extend((name, "stopped") for name in inp.names)
        return len(inp.names)

    @activity.defn(name=names.CHECK_SNAPSHOT)
    def check_snapshot_files(self, inp: CheckSnapshotInput) -> list[str]:
        return check_local_snapshot(self.bucket_root, inp)

    def _serve_replica(self, client: Client, task_queue: str, name: str) -> None:
        """A worker for replica ``name``'s steps on ``task_queue``, running from now on."""
        worker = Worker(
            client,
            task_queue=task_queue,
            activities=self._replica_activities(name),
            # A cancel reaches a step only with a heartbeat's answer: send them often.
            max_heartbeat_throttle_interval=timedelta(milliseconds=200),
            default_heartbeat_throttle_interval=timedelta(milliseconds=200),
        )
        asyncio.create_task(worker.run())
        self._replica_workers[task_queue] = worker

    def _replica_activities(self, replica: str) -> list:
        """The replica steps under their real names: the update from the bucket and the
        broadcast's offer/send/stage/commit; each weight-changing step follows the test's
        behaviour for this replica."""

        # hot-load id -> resolves True once this replica's update from the bucket staged, False
        # if it ended without (what an early offer waits for, as on the real agent).
        bucket_stages: dict[str, asyncio.Future[bool]] = {}

        def bucket_stage(hot_load_id: str) -> asyncio.Future[bool]:
            return bucket_stages.setdefault(hot_load_id, asyncio.get_running_loop().create_future())

        async def step(inp: ApplySnapshotInput, source: str) -> ApplySnapshotResult:
            ready = bucket_stage(inp.hot_load_id) if source == "bucket" else None
            try:
                behaviour = self.apply_behaviour.get(replica)
                if behaviour is not None:
                    await behaviour(replica, inp)
                else:
                    await asyncio.sleep(self.apply_delay)
                if ready is not None:
                    if not ready.done():
                        ready.set_result(True)
                    swap = self.swap_behaviour.get(replica)
                    if swap is not None:
                        await swap(replica)
            finally:
                if ready is not None and not ready.done():
                    ready.set_result(False)
            self.applied.append((replica, inp.identity))
            self.peer_events.append((replica, "applied"))
            return ApplySnapshotResult(
                identity=inp.identity,
                engine_pid=1,
                tensors_loaded=1,
                bytes_read_from_bucket=1,
                pause_ms=1.0,
                links_applied=[link.identity for link in inp.chain],
                source=source,
            )

        @activity.defn(name=names.APPLY_SNAPSHOT)
        async def apply_snapshot(inp: ApplySnapshotInput) -> ApplySnapshotResult:
            return await step(inp, "bucket")

        staged: dict[str, PeerOffer] = {}

        @activity.defn(name=names.OFFER_TO_PEER)
        async def offer_to_peer(inp: PeerOfferInput) -> PeerOffer:
            if inp.from_stage and inp.identity in staged:
                # a receiver passes its peer stage on, swapped in or not (as replica agents do)
                self.peer_events.append((replica, "offered"))
            elif inp.peer_stage:
                raise ApplicationError(
                    f"{replica} holds no stage of {inp.identity} from a peer",
                    type=PEER_OFFER_REFUSED,
                    non_retryable=True,
                )
            elif inp.from_stage:
                ready = bucket_stage(inp.hot_load_id)
                while not ready.done():
                    activity.heartbeat()
                    await asyncio.wait({ready}, timeout=0.05)
                self.peer_events.append((replica, "offered"))
                if not ready.result() or self.refuse_early_offer:
                    raise ApplicationError(
                        f"{replica} holds no delta files to offer before its swap",
                        type=PEER_OFFER_REFUSED,
                        non_retryable=True,
                    )
            return PeerOffer(
                source_replica=replica,
                host="127.0.0.1",
                port=1,
                backend="test",
                base_identity=inp.target_identity,
                identity=inp.identity,
                chain=inp.chain,
                specs=[],
                expected_adler32={},
            )

        @activity.defn(name=names.SEND_TO_PEERS)
        async def send_to_peers(offer: PeerOffer) -> int:
            self.peer_events.append((replica, "sent"))
            return 0

        @activity.defn(name=names.STAGE_FROM_PEER)
        async def stage_from_peer(inp: StageFromPeerInput) -> StageFromPeerResult:
            behaviour = self.stage_behaviour.get(replica)
            if behaviour is not None:
                await behaviour(replica)
            staged[inp.offer.identity] = inp.offer
            self.peer_events.append((replica, "staged"))
            return StageFromPeerResult(identity=inp.offer.identity, tensors_staged=0, bytes_received=0, stage_ms=0.0)

        @activity.defn(name=names.COMMIT_PEER_STAGE)
        async def commit_peer_stage(inp: CommitPeerStageInput) -> ApplySnapshotResult:
            self.peer_events.append((replica, "commit"))
            offer = staged[inp.identity]
            behaviour = self.commit_behaviour.get(replica)
            if behaviour is not None:
                await behaviour(replica)
            as_apply = ApplySnapshotInput(
                hot_load_id="peer",
                identity=offer.identity,
                chain=offer.chain,
                bucket="-",
                path_prefix="-",
            )
            return await step(as_apply, f"peer:{offer.source_replica}")

        @activity.defn(name=names.SERVE_REPLICA)
        async def serve_replica() -> None:
            self.peer_events.append((replica, "served"))

        @activity.defn(name=names.DRAIN_REPLICA)
        async def drain_replica(inp: DrainInput) -> float:
            self.drained.append(replica)
            self.peer_events.append((replica, "drained"))
            return 0.0

        return [
            apply_snapshot,
            offer_to_peer,
            send_to_peers,
            stage_from_peer,
            commit_peer_stage,
            serve_replica,
            drain_replica,
        ]

    async def held(self, replica: str, inp: ApplySnapshotInput) -> None:
        """An apply that waits for `hold` (heartbeating), then succeeds; a cancel interrupts it
        (the step rolled back: the replica keeps its previous weights)."""
        self.started.set()
        while not self.hold.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.05)

    async def held_then_finish(self, replica: str, inp: ApplySnapshotInput) -> None:
        """Like `held`, but a cancel arriving mid-step lets the step finish, as the replica agent
        does for its all-or-nothing engine swap (replica/agent/activities.py)."""
        self.started.set()
        while not self.hold.is_set():
            activity.heartbeat()
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                self.cancel_seen.set()
                await asyncio.sleep(0.1)
                return

    @staticmethod
    async def broken(replica: str, inp: ApplySnapshotInput) -> None:
        raise ApplicationError(
            f"tensor w: Adler-32 mismatch in {inp.identity}", type=NON_RETRYABLE_SNAPSHOT, non_retryable=True
        )


def check_local_snapshot(bucket_root: Path, inp: CheckSnapshotInput) -> list[str]:
    """The real admission check (control/activities.py: its file rules, fingerprint and errors),
    against a directory standing in for the bucket (a file's version is its mtime)."""
    return check_snapshot(inp, bucket_root / inp.path_prefix / inp.identity)


async def poll(check: Callable[[], Awaitable[Any]], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await check()
        if got is not None:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout}s")
        await asyncio.sleep(every)
