"""Where a request goes, and what the gateway knows about the weights each replica serves.

``Router.route`` picks the deployment a request's ``model`` names (weighted split:
``gateway/split.py``), ``Router.candidates`` orders its replicas (session pin, then least
loaded, recently failed last), and ``pin`` / ``acquire`` / ``release`` / ``mark_failed`` record
each try. Invariants: a gateway serves only the deployments that list its id in ``gatewayIds``,
and a token only its organization's; only replicas a deployment lists as running are candidates;
views come from Temporal (``refresh_loop``) keyed by workflow id (``deployments/ORG/ID``), and
``fresh_view`` / ``fresh_route`` read after the call began. ``weight_versions`` labels an answer.
The rules: docs/design.md "The gateway".
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from common.flight import SingleFlight
from common.settings import temporal_client
from contracts.autoscaling import TARGET_IN_FLIGHT, policy
from contracts.memo import replica_list
from contracts.names import hot_load_workflow_id
from contracts.records import Autoscaling
from gateway.split import WeightedSplit

log = logging.getLogger("rollouts.gateway")

SESSION_TTL_S = 600.0
COOLDOWN_S = 5.0
REFRESH_S = 0.5
DISCOVER_S = 2.0
MAX_SESSIONS = 100_000
NO_TRAFFIC_STATUSES = ("STATUS_FAILED", "STATUS_DELETING")


@dataclass(frozen=True)
class ReplicaView:
    name: str
    engine_url: str
    identity: str
    # False while the replica's weights may be changing (its hot-load step is under way), or when
    # the running hot-load's state could not be read.
    settled: bool = True
    # True when an active hot-load has not reached this replica yet (its weights are the old ones).
    pending: bool = False
    # Its Dynamo worker id (hex) in a dynamo stack; "" for a vLLM server replica.
    dynamo_worker: str = ""


@dataclass(frozen=True)
class DeploymentView:
    deployment_id: str
    model_name: str
    workflow_id: str
    engine_config: dict[str, str]
    organization_id: str
    replicas: tuple[ReplicaView, ...]
    active_hot_load_id: str | None = None
    # Counts the hot-loads this gateway has seen start on the deployment.
    epoch: int = 0
    read_at: float = 0.0  # time.monotonic() when the read began
    gateway_ids: tuple[str, ...] = ()  # spec.gatewayIds: the gateways that serve it
    weight: int = 100  # spec.traffic.weight: its share among deployments of the same model name
    status: str = "STATUS_READY"  # status.status
    # spec.autoscaling: whether it scales (max > min), and the requests in flight per serving
    # replica that make it busy (gateway/load.py reports its load).
    scales: bool = False
    target_in_flight: int = TARGET_IN_FLIGHT

    @property
    def takes_traffic(self) -> bool:
        """It lists running replicas and is neither failed nor being deleted."""
        return bool(self.replicas) and self.status not in NO_TRAFFIC_STATUSES

    def describe(self) -> str:
        return f"{self.deployment_id} ({self.status}, {len(self.replicas)} running replica(s), weight {self.weight})"

    @property
    def dynamo(self) -> bool:
        """Its replicas are Dynamo workers: requests go through Dynamo's frontend."""
        return bool(self.replicas) and all(r.dynamo_worker for r in self.replicas)

    def dynamo_workers(self) -> dict[int, ReplicaView]:
        """Dynamo worker id -> replica."""
        return {int(r.dynamo_worker, 16): r for r in self.replicas if r.dynamo_worker}

    def replica(self, name: str) -> ReplicaView | None:
        return next((r for r in self.replicas if r.name == name), None)


def build_view(
    deployment_memo: dict[str, Any],
    workflow_id: str,
    hot_load_memo: dict[str, Any] | None,
    *,
    hot_load_readable: bool = True,
    epoch: int = 0,
    read_at: float = 0.0,
) -> DeploymentView | None:
    """A view from a deployment workflow's memo and, if one is active, its hot-load's memo."""
    dep = deployment_memo.get("deployment") or {}
    spec = dep.get("spec") or {}
    if not spec:
        return None
    status = dep.get("status") or {}
    active = status.get("activeHotLoadId")
    steps = {r.get("name"): r for r in replica_list(hot_load_memo or {})}
    replicas = []
    for r in replica_list(deployment_memo):
        name, identity = r.get("name", ""), r.get("currentSnapshotIdentity") or "initial"
        settled, pending = True, False
        if active:
            step = steps.get(name)
            if not hot_load_readable:
                settled = False
            elif step is not None:
                state = step.get("state")
                if state == "UPDATING":
                    settled = False
                elif state == "PENDING_UPDATE":
                    pending = True
                identity = step.get("currentSnapshotIdentity") or identity
        replicas.append(
            ReplicaView(name, r.get("engineUrl", ""), identity, settled, pending, str(r.get("dynamoWorker") or ""))
        )
    return DeploymentView(
        deployment_id=spec["id"],
        model_name=(spec.get("model") or {}).get("name", spec["id"]),
        workflow_id=workflow_id,
        engine_config=dict((spec.get("runtime") or {}).get("engineConfig") or {}),
        organization_id=spec.get("organizationId", ""),
        replicas=tuple(replicas),
        active_hot_load_id=active,
        epoch=epoch,
        read_at=read_at,
        gateway_ids=tuple(g for g in spec.get("gatewayIds") or [] if isinstance(g, str)),
        weight=_weight(spec),
        status=str(status.get("status") or "STATUS_CREATING"),
        **_autoscaling(spec),
    )


def _autoscaling(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        p = policy(Autoscaling.model_validate(spec.get("autoscaling") or {}))
    except ValueError:
        return {}
    return {"scales": p.scales, "target_in_flight": p.target_in_flight}


def _weight(spec: dict[str, Any]) -> int:
    weight = (spec.get("traffic") or {}).get("weight", 100)
    return weight if isinstance(weight, int) and not isinstance(weight, bool) else 0


def weight_versions(
    before: ReplicaView | None,
    after: ReplicaView | None,
    before_epoch: int,
    after_epoch: int,
    replica: str,
    spans: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``nvext.weight_versions`` for one response served by ``replica``.

    With ``spans`` (the replica's own per-token record) the answer is exact and needs no view.
    Without them, ``exact``/``identity`` are set only when the replica was settled on one identity
    in a view read before the request and one read after it, and no hot-load reached it between;
    otherwise ``identities`` lists what may have produced the tokens, in load order. Not covered:
    an unseen A -> B -> A between two reads.
    """
    if spans:
        named = _load_order(spans)
        one = len(named) == 1
        return {
            "identity": named[0] if one else None,
            "exact": one,
            "identities": named,
            "replica": replica,
            "spans": spans,
        }
    ids: list[str] = []
    for view in (before, after):
        if view is not None and view.identity not in ids:
            ids.append(view.identity)
    exact = (
        before is not None
        and after is not None
        and before.settled
        and after.settled
        and before.identity == after.identity
        and (after_epoch == before_epoch or (after_epoch == before_epoch + 1 and after.pending))
    )
    out: dict[str, Any] = {
        "identity": ids[0] if exact else None,
        "exact": bool(exact),
        "identities": ids,
        "replica": replica,
    }
    if spans is not None:
        out["spans"] = spans  # reported, and empty: the answer has no completion tokens
    return out


def _load_order(spans: list[dict[str, Any]]) -> list[str]:
    """The identities ``spans`` name, ordered as loaded: each choice's spans are in time order,
    but choices of one request may start in different engine steps, so merge their orders."""
    named = list(dict.fromkeys(s["identity"] for s in spans))
    later: dict[str, set[str]] = {v: set() for v in named}
    for a, b in zip(spans, spans[1:]):
        if a["choice"] == b["choice"]:
            later[a["identity"]].add(b["identity"])
    order: list[str] = []
    while len(order) < len(named):
        # The first identity (in order of appearance) that no remaining identity precedes; an
        # identity loaded twice (A -> B -> A) makes a cycle: then take them as they appear.
        left = [v for v in named if v not in order]
        free = [v for v in left if not any(v in later[u] for u in left if u != v)]
        order.append((free or left)[0])
    return order


@dataclass
class Router:
    # By workflow id (deployments/ORG/ID): deployment ids are unique only within an organization.
    views: dict[str, DeploymentView] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)  # engine url -> requests
    failed_at: dict[str, float] = field(default_factory=dict)  # engine url -> last connect failure
    cooldown_s: float = COOLDOWN_S  # how long a replica whose connection failed is tried last
    sessions: dict[str, tuple[str, float]] = field(default_factory=dict)  # session -> (replica name, time)
    # Serve only deployments that list this gateway id (None: every deployment; a table in a test).
    gateway_id: str | None = None
    split: WeightedSplit = field(default_factory=WeightedSplit)
    # Set by refresh_loop: reads one deployment's view now, by workflow id (None: the workflow is gone).
    reader: Callable[[str], Awaitable[DeploymentView | None]] | None = None
    # Set by refresh_loop: lists the running deployments now and reads the views of new ones.
    discoverer: Callable[[], Awaitable[None]] | None = None
    # Reads that start after their caller arrived (common/flight.py, `after_call`).
    _reads: dict[str, SingleFlight] = field(default_factory=dict)
    _discovery: SingleFlight = field(default_factory=lambda: SingleFlight(after_call=True))
    _last_active: dict[str, str | None] = field(default_factory=dict)
    _epochs: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ table
    def set_view(self, view: DeploymentView) -> None:
        self.views[view.workflow_id] = view

    def drop(self, workflow_id: str) -> None:
        self.views.pop(workflow_id, None)

    def serves(self, view: DeploymentView) -> bool:
        return self.gateway_id is None or self.gateway_id in view.gateway_ids

    def models(self, organization_id: str | None = None) -> list[DeploymentView]:
        """The deployments this gateway serves, within ``organization_id`` if given (another
        organization's deployment is not found, as in the REST API), by model name then id."""
        views = [
            v
            for v in self.views.values()
            if (organization_id is None or v.organization_id == organization_id) and self.serves(v)
        ]
        return sorted(views, key=lambda v: (v.model_name, v.deployment_id))

    def route(
        self, model: str | None, organization_id: str | None = None, session: str | None = None
    ) -> tuple[list[DeploymentView], DeploymentView | None]:
        """``(named, chosen)``: the deployments ``model`` names (empty: not served here) and the
        one this request goes to (None: none of them takes traffic); see the module docstring."""
        mine = self.models(organization_id)
        by_id = [v for v in mine if model and v.deployment_id == model]
        if by_id:
            named = by_id
        elif model:
            named = [v for v in mine if v.model_name == model]
        else:
            named = mine if len({v.model_name for v in mine}) == 1 else []
        live = [v for v in named if v.takes_traffic and (by_id or v.weight > 0)]
        now = time.monotonic()
        # Prefer deployments with a replica whose connection has not just failed.
        pool = [v for v in live if any(not self._cooling(r.engine_url, now) for r in v.replicas)] or live
        if not pool:
            return named, None
        pinned = self.sessions.get(session) if session else None
        if pinned and now - pinned[1] < SESSION_TTL_S:
            home = next((v for v in pool if v.replica(pinned[0]) is not None), None)
            if home is not None:
                return named, home
        if len(pool) == 1:
            return named, pool[0]
        key = (pool[0].organization_id, pool[0].model_name)
        chosen = self.split.pick(key, [(v.deployment_id, v.weight) for v in pool])
        return named, next(v for v in pool if v.deployment_id == chosen)

    # ------------------------------------------------------------------ choice
    def candidates(self, view: DeploymentView, session: str | None) -> list[ReplicaView]:
        now = time.monotonic()
        reps = list(view.replicas)
        random.shuffle(reps)  # ties among equally loaded replicas go to any of them
        cooling = {r.engine_url for r in reps if self._cooling(r.engine_url, now)}
        ordered = sorted(reps, key=lambda r: (r.engine_url in cooling, self.in_flight.get(r.engine_url, 0)))
        if session:
            pinned = self.sessions.get(session)
            if pinned and now - pinned[1] < SESSION_TTL_S:
                first = next((r for r in ordered if r.name == pinned[0] and r.engine_url not in cooling), None)
                if first is not None:
                    ordered = [first] + [r for r in ordered if r is not first]
        return ordered

    def _cooling(self, url: str, now: float) -> bool:
        return now - self.failed_at.get(url, -1e9) < self.cooldown_s

    def pin(self, session: str | None, replica: str) -> None:
        if not session:
            return
        self.sessions[session] = (replica, time.monotonic())
        if len(self.sessions) > MAX_SESSIONS:  # bound memory: drop the oldest half
            for key, _ in sorted(self.sessions.items(), key=lambda kv: kv[1][1])[: MAX_SESSIONS // 2]:
                self.sessions.pop(key, None)

    def acquire(self, url: str) -> None:
        self.in_flight[url] = self.in_flight.get(url, 0) + 1

    def release(self, url: str) -> None:
        self.in_flight[url] = max(0, self.in_flight.get(url, 1) - 1)

    def mark_failed(self, url: str) -> None:
        self.failed_at[url] = time.monotonic()

    def mark_ok(self, url: str) -> None:
        self.failed_at.pop(url, None)

    # ------------------------------------------------------------------ views
    def epoch_for(self, workflow_id: str, active: str | None) -> int:
        """Count hot-loads as they are first seen active (for ``weight_versions``)."""
        last = self._last_active.get(workflow_id)
        if active and active != last:
            self._epochs[workflow_id] = self._epochs.get(workflow_id, 0) + 1
        self._last_active[workflow_id] = active
        return self._epochs.get(workflow_id, 0)

    async def fresh_view(self, workflow_id: str) -> DeploymentView | None:
        """A view whose read started after this call; concurrent callers share one read (``SingleFlight``)."""
        if self.reader is None:
            return self.views.get(workflow_id)
        reads = self._reads.setdefault(workflow_id, SingleFlight(after_call=True))
        return await reads.join(lambda: self._read(workflow_id))

    async def fresh_route(
        self, model: str | None, organization_id: str | None = None, session: str | None = None
    ) -> tuple[list[DeploymentView], DeploymentView | None]:
        """``route``, but a request that finds no deployment to take it reads afresh first: the
        views of the deployments it names (none takes traffic), or the list of running
        deployments (it names none: one created since the last discovery), each read started
        after this call. What the API has answered (READY, running replicas) is then what the
        gateway routes by."""
        named, chosen = self.route(model, organization_id, session)
        if chosen is not None:
            return named, chosen
        if named:
            await asyncio.gather(*(self.fresh_view(v.workflow_id) for v in named))
        elif self.discoverer is not None:
            await self._discovery.join(self.discoverer)
        return self.route(model, organization_id, session)

    async def _read(self, workflow_id: str) -> DeploymentView | None:
        assert self.reader is not None
        view = await self.reader(workflow_id)
        if view is not None:
            current = self.views.get(workflow_id)
            if current is None or current.read_at <= view.read_at:
                self.set_view(view)
        return view


async def refresh_loop(router: Router, settings: Any) -> None:
    """Keep ``router`` current from Temporal until cancelled; see the module docstring."""
    client: Client | None = None
    workflow_ids: list[str] = []  # the running deployment workflows (deployments/ORG/ID)

    async def read(wf_id: str) -> DeploymentView | None:
        assert client is not None
        started = time.monotonic()
        try:
            desc = await client.get_workflow_handle(wf_id).describe()
        except RPCError as exc:
            log.warning("reading %s failed: %s", wf_id, exc)
            return router.views.get(wf_id)
        if desc.status is None or desc.status.name != "RUNNING":
            router.drop(wf_id)
            return None
        memo = await desc.memo()
        active = ((memo.get("deployment") or {}).get("status") or {}).get("activeHotLoadId")
        hot_memo, readable = None, True
        if active:
            try:
                org = memo["deployment"]["spec"]["organizationId"]
                hot_memo = await (await client.get_workflow_handle(hot_load_workflow_id(org, active)).describe()).memo()
            except RPCError as exc:
                # Not found: the deployment marks it active while its admission still runs (the
                # workflow starts after); held unreadable until it exists, which is expected.
                not_yet = exc.status == RPCStatusCode.NOT_FOUND
                (log.debug if not_yet else log.warning)("reading hot-load %s failed: %s", active, exc)
                readable = False
        epoch = router.epoch_for(wf_id, active)
        return build_view(
            memo,  # type: ignore[arg-type]  # memo(): a dict, typed Mapping
            wf_id,
            hot_memo,  # type: ignore[arg-type]
            hot_load_readable=readable,
            epoch=epoch,
            read_at=started,
        )

    last_discovery: float  # set before the first discover() (below)

    async def discover() -> None:
        nonlocal workflow_ids, last_discovery
        assert client is not None
        found: list[str] = []
        async for wf in client.list_workflows(
            "ResourceKind='deployment' AND ExecutionStatus='Running'", page_size=1000
        ):
            found.append(wf.id)  # deployments/ORG/ID (contracts/names.py)
        for gone in set(router.views) - set(found):
            router.drop(gone)
        new = [wf_id for wf_id in found if wf_id not in router.views]
        workflow_ids = found
        last_discovery = time.monotonic()
        await asyncio.gather(*(router.fresh_view(d) for d in new), return_exceptions=True)

    last_discovery = 0.0
    while True:
        try:
            if client is None:
                client = await temporal_client(settings)
                router.reader = read
                router.discoverer = discover
            if time.monotonic() - last_discovery > DISCOVER_S:
                await router._discovery.join(discover)
            await asyncio.gather(*(router.fresh_view(d) for d in list(workflow_ids)), return_exceptions=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep the last table; Temporal may restart
            log.warning("routing refresh failed: %s", exc)
        await asyncio.sleep(REFRESH_S)
