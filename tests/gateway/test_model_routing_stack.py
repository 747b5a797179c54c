"""Routing by model name at the stack's real gateway, with real deployments sharing the shared
deployment's ``model.name``: a FAILED one (its model path holds no checkpoint, so its replica
fails to start) takes no traffic, also where the gateway's table lists it first; one that lists
only another gateway is not served here at all; a READY one with nine times the shared
deployment's ``traffic.weight`` (90 against 10: the module sets the shared deployment's weight
to 10 and puts it back after) takes exactly 9 of every 10 requests (the split is deterministic,
``gateway/split.py``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from common.settings import temporal_client
from contracts.names import deployment_workflow_id
from gateway.routing import DeploymentView, Router, build_view
from tests.helpers.gateway import GatewayDeployment, LocalGateway, random_prompt
from tests.helpers.ready import first_requests_served
from tests.helpers.stack_fixtures import deployment_body

pytestmark = pytest.mark.stack
REPLICA = "x-rollouts-replica"


@dataclass
class Extra:
    failed: str  # same model name, no checkpoint at its model path: STATUS_FAILED
    elsewhere: str  # same model name, lists only another gateway
    split: str  # same model name, 1 replica, 9x the shared deployment's weight
    other_gateway: str


def models(gw: GatewayDeployment) -> list[dict[str, Any]]:
    """The deployments ``/v1/models`` lists, each with its model name as ``id`` (the listing
    names each model once, its deployments under it: gateway/listing.py)."""
    r = httpx.get(f"{gw.url}/v1/models", headers=gw.headers, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len({m["id"] for m in data}) == len(data), data  # each model name once
    return [{"id": m["id"], **d} for m in data for d in m["deployments"]]


def wait_listed(gw: GatewayDeployment, dep_id: str, ok, what: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        entry = next((m for m in models(gw) if m["deployment_id"] == dep_id), None)
        if entry is not None and ok(entry):
            return entry
        assert time.monotonic() < deadline, f"the gateway does not list {dep_id} {what}: {entry}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def extra(gw: GatewayDeployment) -> Iterator[Extra]:
    tag = uuid.uuid4().hex[:6]
    other = f"gw-other-{tag}"
    r = gw.api.call("POST", "/gateways", json={"id": other, "name": "other", "zones": [gw.settings.zone]})
    assert r.status_code == 200, r.text
    shared_weight = gw.deployment["spec"]["traffic"]["weight"]

    def set_shared_weight(weight: int) -> None:
        gw.api.wait_deployment(gw.id)  # READY, so that an update is admitted
        body = {"traffic": {"weight": weight}, "hotLoad": gw.deployment["spec"]["hotLoad"]}
        r = gw.api.call("PATCH", f"/deployments/{gw.id}", json=body)
        assert r.status_code == 200, r.text

    def create(name: str, *, path: str | None = None, gateways: list[str] | None = None, weight: int = 100) -> str:
        body = deployment_body(gw.settings, f"{name}-{tag}", replicas=1, path_prefix=f"checkpoints/{name}-{tag}")
        body["model"]["name"] = gw.model
        if path is not None:
            body["model"]["path"] = path
        if gateways is not None:
            body["gatewayIds"] = gateways
        body["traffic"] = {"weight": weight}
        r = gw.api.call("POST", "/deployments", json=body)
        assert r.status_code == 200, r.text
        return r.json()["deployment"]["spec"]["id"]

    missing = f"models/no-checkpoint-{tag}"
    made = Extra(
        failed=create("gwfailed", path=missing),
        elsewhere=create("gwelsewhere", path=missing, gateways=[other]),
        split=create("gwsplit", weight=90),
        other_gateway=other,
    )
    set_shared_weight(10)
    try:
        yield made
    finally:
        for dep in (made.split, made.failed, made.elsewhere):
            gw.api.call("DELETE", f"/deployments/{dep}")
        deadline = time.monotonic() + 300
        # The shared deployment must take every request again before the next test module.
        while {made.split, made.failed} & {m["deployment_id"] for m in models(gw)} and time.monotonic() < deadline:
            time.sleep(1)
        while gw.api.call("GET", f"/deployments/{made.elsewhere}").status_code != 404 and time.monotonic() < deadline:
            time.sleep(1)
        gw.api.call("DELETE", f"/gateways/{other}")
        set_shared_weight(shared_weight)


async def view_of(gw: GatewayDeployment, dep_id: str) -> DeploymentView:
    """A deployment's routing view, built from its workflow's memo as the gateway builds it."""
    wf_id = deployment_workflow_id(gw.settings.organization_id, dep_id)
    client = await temporal_client(gw.settings)
    view = build_view(await (await client.get_workflow_handle(wf_id).describe()).memo(), wf_id, None)
    assert view is not None
    return view


def served(gw: GatewayDeployment, count: int) -> list[str]:
    names = []
    for _ in range(count):
        r = gw.post("/v1/completions", {"prompt": random_prompt(4), "max_tokens": 1})
        assert r.status_code == 200, r.text
        names.append(r.headers[REPLICA])
    return names


def test_a_failed_deployment_sharing_the_model_name_takes_no_traffic(gw, extra):
    dep = gw.api.wait_deployment(extra.failed, timeout=600)
    assert dep["status"]["status"] == "STATUS_FAILED", dep["status"]
    assert any("no objects under" in c["message"] for c in dep["status"]["conditions"]), dep["status"]
    # The gateway knows it, by the same model name, failed: the case that black-holed the name.
    entry = wait_listed(gw, extra.failed, lambda m: m["status"] == "STATUS_FAILED", "as failed")
    assert entry["id"] == gw.model and entry["takes_traffic"] is False and entry["replicas"] == []
    shared = {r["name"] for r in (next(m for m in models(gw) if m["deployment_id"] == gw.id))["replicas"]}
    names = served(gw, 8)
    split = {r["name"] for m in models(gw) if m["deployment_id"] == extra.split for r in m["replicas"]}
    assert set(names) <= shared | split, names  # never the failed one (it has no replica to name)
    # The same through a gateway whose table lists the failed one first (as after a gateway
    # restart, when discovery lists the newest deployment first): the order that black-holed it.
    router = Router()
    for dep_id in (extra.failed, gw.id):
        router.set_view(asyncio.run(view_of(gw, dep_id)))
    with LocalGateway(gw.settings, router) as local:
        for _ in range(4):
            r = httpx.post(
                f"{local.url}/v1/completions",
                json={"model": gw.model, "prompt": random_prompt(4), "max_tokens": 1},
                headers=gw.headers,
                timeout=300,
            )
            assert r.status_code == 200 and r.headers[REPLICA] in shared, r.text
    # Addressed by its id, it is named in a 503 with its state, not routed.
    r = gw.post("/v1/completions", {"model": extra.failed, "prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
    assert f"{extra.failed} (STATUS_FAILED, 0 running replica(s)" in r.json()["message"]


def test_a_deployment_of_another_gateway_is_not_served_here(gw, extra):
    dep = gw.api.wait_deployment(extra.elsewhere, timeout=600)
    assert dep["spec"]["gatewayIds"] == [extra.other_gateway] and dep["spec"]["model"]["name"] == gw.model
    wait_listed(gw, extra.failed, lambda m: True, "at all")  # the gateway has read deployments created with it
    assert extra.elsewhere not in {m["deployment_id"] for m in models(gw)}
    r = gw.post("/v1/completions", {"model": extra.elsewhere, "prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text


def test_two_ready_deployments_sharing_the_name_split_ninety_ten(gw, extra):
    dep = gw.api.wait_deployment(extra.split, timeout=900)
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    assert gw.id in first_requests_served(gw.settings, extra.split).beside  # the premise: another beside
    entry = wait_listed(gw, extra.split, lambda m: m["takes_traffic"] and len(m["replicas"]) == 1, "serving")
    split_replica = entry["replicas"][0]["name"]
    shared = wait_listed(
        gw,
        gw.id,
        lambda m: m["takes_traffic"] and len(m["replicas"]) == 2 and m["weight"] == 10,
        "serving at weight 10",
    )
    assert entry["weight"] == 9 * shared["weight"]
    names = served(gw, 40)
    by_deployment = Counter("split" if n == split_replica else "shared" for n in names)
    assert by_deployment == {"split": 36, "shared": 4}, names
    # The shared deployment's 1 in 10 never comes twice in a row.
    assert all(not (a != split_replica and b != split_replica) for a, b in zip(names, names[1:])), names
