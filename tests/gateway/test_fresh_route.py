"""``Router.fresh_route`` (``gateway/routing.py``): a request that finds no deployment to take it
reads afresh before the gateway answers 503 or 404, so what the API has reported (READY, running
replicas; a deployment just created) is what the gateway routes by. No stack, no engine: the
reads are the test's own, counted."""

from __future__ import annotations

import asyncio

from tests.helpers.views import router, view


async def test_no_running_replica_in_the_table_reads_the_deployment_again_before_503():
    r = router(view("d1", replicas=0, status="STATUS_CREATING"))
    reads: list[str] = []

    async def reader(workflow_id: str):
        reads.append(workflow_id)
        return view("d1", replicas=2)  # what the workflow's memo says now: READY, 2 running

    r.reader = reader
    assert r.route("policy", "org")[1] is None  # the table alone would answer 503
    named, chosen = await r.fresh_route("policy", "org")
    assert chosen is not None and chosen.deployment_id == "d1" and len(chosen.replicas) == 2
    assert reads == ["deployments/org/d1"]
    # Once it takes traffic, requests are routed from the table without another read.
    assert (await r.fresh_route("policy", "org"))[1] is not None and reads == ["deployments/org/d1"]


async def test_still_nothing_after_the_fresh_read_is_still_no_deployment():
    r = router(view("d1", replicas=0, status="STATUS_CREATING"))

    async def reader(workflow_id: str):
        return view("d1", replicas=0, status="STATUS_CREATING")

    r.reader = reader
    named, chosen = await r.fresh_route("policy", "org")
    assert chosen is None and [v.deployment_id for v in named] == ["d1"]


async def test_a_model_not_in_the_table_lists_the_running_deployments_again():
    r = router(view("old", model="other"))
    found: list[int] = []

    async def discoverer():
        found.append(1)
        await asyncio.sleep(0.01)
        r.set_view(view("new", model="policy"))

    r.discoverer = discoverer
    # Concurrent requests for it share the discovery (one in flight, one queued at most).
    answers = await asyncio.gather(*(r.fresh_route("policy", "org") for _ in range(8)))
    assert all(chosen is not None and chosen.deployment_id == "new" for _, chosen in answers)
    assert 1 <= len(found) <= 2
    # Another organization's token still finds nothing: discovery does not widen the scope.
    assert (await r.fresh_route("policy", "org-b")) == ([], None)
