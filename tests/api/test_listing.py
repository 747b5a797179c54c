"""Reading operations on the real Temporal dev server: `GET /hotLoads?parentDeploymentId=` newest
first with working pages over closed and open operations, stable when a hot-load is created
between two pages, the same after an API restart with no worker running; replicas paginated by
(zone, name); a terminated workflow reported truthfully; search attributes that find failed loads.
Listings and closed operations answer from memory (api/listing.py): concurrent first reads share
one visibility read, a warm listing and a closed operation need no Temporal call, an operation
created here is listed at once, and changes made elsewhere reach the listing by its refreshes.
"""

from __future__ import annotations

import asyncio

from contracts import names
from rollouts.client import hot_load_body
from tests.helpers.harness import ORG, OTHER_ORG, Fleet, poll, write_full
from tests.helpers.workflow_checks import error, every


async def walk(f: Fleet, dep: str, size: int) -> list[dict]:
    out, token, seen_tokens = [], None, set()
    while True:
        params = {"parentDeploymentId": dep, "maxPageSize": size}
        if token:
            params["pageToken"] = token
        r = await f.call("GET", "/hotLoads", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["hotLoads"]) <= size
        out += body["hotLoads"]
        token = body.get("nextPageToken")
        if not token:
            return out
        assert token not in seen_tokens, "a listing that repeats a page token is an error (cwtrain)"
        seen_tokens.add(token)


async def test_history_newest_first_over_closed_and_open_operations(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        other = await f.ready_deployment()
        root = f.bucket_root / f"ckpt/{dep}"
        created: list[str] = []
        await f.completed(other, "x")  # another deployment's history stays out
        for i in range(5):
            created.append((await f.completed(dep, f"s{i}", hotLoadId=f"ok-{i}"))["spec"]["id"])
        f.apply_behaviour = every(f.broken)
        write_full(root, "bad")
        r = await f.create_hot_load(dep, "bad", hotLoadId="failed-1")
        assert (await f.wait_hot_load("failed-1"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        created.append("failed-1")
        await f.wait_idle(dep)
        f.apply_behaviour = every(f.held)
        r = await f.create_hot_load(dep, "s0", hotLoadId="canceled-1")
        assert r.status_code == 200
        await asyncio.wait_for(f.started.wait(), 30)
        assert (await f.call("POST", "/hotLoads/canceled-1:cancel", json={})).json()["hotLoad"]["status"]["state"] == (
            "HOT_LOAD_STATE_CANCELED"
        )
        created.append("canceled-1")
        await f.wait_idle(dep)
        f.started.clear()
        r = await f.create_hot_load(dep, "s1", hotLoadId="open-1")
        assert r.status_code == 200
        created.append("open-1")

        newest_first = list(reversed(created))
        listed = await walk(f, dep, 3)
        assert [h["spec"]["id"] for h in listed] == newest_first
        assert listed[0]["status"]["state"] in ("HOT_LOAD_STATE_PENDING", "HOT_LOAD_STATE_IN_PROGRESS")
        assert [h["status"]["state"] for h in listed[1:3]] == ["HOT_LOAD_STATE_CANCELED", "HOT_LOAD_STATE_FAILED"]
        assert all(h["status"]["workflowUrl"].endswith(h["spec"]["id"]) for h in listed)
        assert [h["spec"]["id"] for h in await walk(f, dep, 1000)] == newest_first
        # Warm: later listings ask visibility only for what may have changed, not for everything.
        index = f.app.state.resources.hot_loads
        loads = index.full_loads
        for _ in range(5):
            await walk(f, dep, 1000)
        assert index.full_loads == loads
        # Stable pages: the first page is read, then a new operation starts; the next page goes on
        # after the last item read, nothing repeated or skipped.
        first = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep, "maxPageSize": 4})).json()
        f.hold.set()
        await f.wait_hot_load("open-1")
        await f.wait_idle(dep)
        f.apply_behaviour = {}
        await f.completed(dep, "s9", hotLoadId="newer")
        rest = (
            await f.call(
                "GET",
                "/hotLoads",
                params={
                    "parentDeploymentId": dep,
                    "maxPageSize": 100,
                    "pageToken": first["nextPageToken"],
                },
            )
        ).json()
        assert [h["spec"]["id"] for h in first["hotLoads"] + rest["hotLoads"]] == newest_first
        assert "nextPageToken" not in rest
        # A token belongs to its filter; other organizations see nothing.
        error(
            await f.call("GET", "/hotLoads", params={"parentDeploymentId": other, "pageToken": first["nextPageToken"]}),
            400,
            "invalid_argument",
            "pageToken",
        )
        r = await f.call("GET", "/hotLoads", token=OTHER_ORG, params={"parentDeploymentId": dep})
        assert r.status_code == 200 and r.json()["hotLoads"] == []

        # An API restart with no worker running: a fresh process, an empty cache, same answers.
        expected = ["newer", *newest_first]
        async with f.other_api(task_queue="no-worker-here") as http:
            got = (await http.get("/hotLoads", params={"parentDeploymentId": dep, "maxPageSize": 1000})).json()
            assert [h["spec"]["id"] for h in got["hotLoads"]] == expected
            states = {h["spec"]["id"]: h["status"]["state"] for h in got["hotLoads"]}
            assert states["failed-1"] == "HOT_LOAD_STATE_FAILED" and states["open-1"] == "HOT_LOAD_STATE_COMPLETED"
            one = (await http.get("/hotLoads/canceled-1")).json()["hotLoad"]
            assert one["status"]["state"] == "HOT_LOAD_STATE_CANCELED" and one["status"]["canceledAt"]


async def test_replicas_paginated_by_zone_then_name(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, replicas_per_deployment=5) as f:
        dep = await f.ready_deployment()
        hl = await f.completed(dep, "s1")
        pages, token = [], None
        while True:
            params = {"maxPageSize": 2, **({"pageToken": token} if token else {})}
            body = (await f.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas", params=params)).json()
            pages.append(body["replicas"])
            token = body.get("nextPageToken")
            if not token:
                break
        assert [len(p) for p in pages] == [2, 2, 1]
        replicas = [r for p in pages for r in p]
        assert [(r["zone"], r["name"]) for r in replicas] == sorted((r["zone"], r["name"]) for r in replicas)
        for r in replicas:
            assert r["state"] == "READY" and r["currentSnapshotIdentity"] == "s1"
            assert r["startedAt"] <= r["finishedAt"] == r["transitionedAt"]
        error(
            await f.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas", params={"maxPageSize": -1}),
            400,
            "invalid_argument",
            "maxPageSize",
        )


async def test_terminated_workflow_reads_as_failed_and_frees_the_deployment(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        f.apply_behaviour = every(f.held)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        assert (await f.create_hot_load(dep, "s1", hotLoadId="killed")).status_code == 200
        await asyncio.wait_for(f.started.wait(), 30)
        await f.client.get_workflow_handle(names.hot_load_workflow_id(ORG, "killed")).terminate(reason="operator")
        hl = (await f.call("GET", "/hotLoads/killed")).json()["hotLoad"]
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED" and hl["status"]["finishedAt"]
        assert hl["status"]["conditions"][-1]["reason"] == "WorkflowTerminated"
        replicas = await f.hot_load_replicas("killed")
        assert replicas[0]["state"] == "ERROR" and "TERMINATED" in replicas[0]["errorReason"]
        assert replicas[1]["state"] == "PENDING_UPDATE"
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        assert listed[0]["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        # The deployment noticed through its watcher (no hot_load_finished signal came).
        await f.wait_idle(dep)
        f.apply_behaviour = {}
        await f.completed(dep, "s1")


async def test_search_attributes_find_failed_loads(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        await f.completed(dep, "good")
        f.apply_behaviour = every(f.broken)
        write_full(f.bucket_root / f"ckpt/{dep}", "bad")
        assert (await f.create_hot_load(dep, "bad", hotLoadId=f"{dep}-bad")).status_code == 200
        assert (await f.wait_hot_load(f"{dep}-bad"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        query = f'DeploymentId="{dep}" AND HotLoadState="HOT_LOAD_STATE_FAILED"'

        async def found() -> list | None:
            rows = [wf async for wf in f.client.list_workflows(query)]
            return rows or None

        rows = await poll(found, 10, "visibility")
        assert [wf.id for wf in rows] == [names.hot_load_workflow_id(ORG, f"{dep}-bad")]
        attrs = rows[0].typed_search_attributes
        values = {pair.key.name: pair.value for pair in attrs}
        assert values["HotLoadIdentity"] == "bad" and values["HotLoadType"] == "SNAPSHOT_TYPE_FULL"
        assert values["OrganizationId"] == "org-a" and values["DeploymentId"] == dep
        completed = [
            wf
            async for wf in f.client.list_workflows(f'DeploymentId="{dep}" AND HotLoadState="HOT_LOAD_STATE_COMPLETED"')
        ]
        assert len(completed) == 1

        # The UI's own status filter (its Failures view) finds the failed load as well.
        async def failed_workflows() -> list | None:
            rows = [wf async for wf in f.client.list_workflows(f'DeploymentId="{dep}" AND ExecutionStatus="Failed"')]
            return rows or None

        rows = await poll(failed_workflows, 10, "visibility of the failed workflow")
        assert [wf.id for wf in rows] == [names.hot_load_workflow_id(ORG, f"{dep}-bad")]


class _NoTemporal:
    """Stands in for the API's Temporal client: any call is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"answered from memory, yet called Temporal ({name})")


async def test_warm_reads_answer_from_memory_and_share_visibility_calls(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        done = [(await f.completed(dep, f"s{i}", hotLoadId=f"m-{i}"))["spec"]["id"] for i in range(3)]
        resources = f.app.state.resources
        index = resources.hot_loads
        # No background refresh and no staleness in this test: only requests drive visibility.
        index.refresh_s = index.stale_s = index.verify_s = 3600.0
        loads = index.full_loads
        firsts = await asyncio.gather(
            *(f.call("GET", "/hotLoads", params={"parentDeploymentId": dep}) for _ in range(10))
        )
        assert index.full_loads == loads + 1  # ten concurrent first reads, one visibility read
        assert all([h["spec"]["id"] for h in r.json()["hotLoads"]] == done[::-1] for r in firsts)
        refreshes = index.refreshes

        real = resources.client
        resources.client = index.client = _NoTemporal()
        try:
            assert [h["spec"]["id"] for h in await walk(f, dep, 2)] == done[::-1]
            one = (await f.call("GET", f"/hotLoads/{done[0]}")).json()["hotLoad"]
            assert one["status"]["state"] == "HOT_LOAD_STATE_COMPLETED" and one["status"]["workflowUrl"]
            replicas = await f.hot_load_replicas(done[0])
            assert {r["state"] for r in replicas} == {"READY"}
        finally:
            resources.client = index.client = real

        # Created here: listed as soon as the create returns; its end, read by GET, is listed too.
        write_full(f.bucket_root / f"ckpt/{dep}", "s9")
        assert (await f.create_hot_load(dep, "s9", hotLoadId="m-new")).status_code == 200
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        assert [h["spec"]["id"] for h in listed] == ["m-new", *done[::-1]]
        assert (await f.wait_hot_load("m-new"))["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        assert listed[0]["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        assert (index.full_loads, index.refreshes) == (loads + 1, refreshes)


async def test_listing_follows_changes_made_elsewhere(temporal_env, tmp_path):
    """Another API process creates a hot-load, an operator terminates one: a warm listing here
    shows both through its background refreshes, without a GET of either."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        await f.completed(dep, "s0", hotLoadId="e-0")
        params = {"parentDeploymentId": dep}
        assert [h["spec"]["id"] for h in (await f.call("GET", "/hotLoads", params=params)).json()["hotLoads"]] == [
            "e-0"
        ]

        async def listed() -> list[tuple[str, str]]:
            body = (await f.call("GET", "/hotLoads", params=params)).json()
            return [(h["spec"]["id"], h["status"]["state"]) for h in body["hotLoads"]]

        async def until(expected: list[tuple[str, str]]) -> None:
            async def check() -> bool | None:
                return True if await listed() == expected else None

            await poll(check, 60, f"listing {expected}", every=0.1)

        async with f.other_api() as http:
            write_full(f.bucket_root / f"ckpt/{dep}", "s1")
            f.apply_behaviour = every(f.held)
            r = await http.post("/hotLoads", json=hot_load_body(dep, "s1", hot_load_id="e-1"))
            assert r.status_code == 200, r.text
        await asyncio.wait_for(f.started.wait(), 30)
        await until([("e-1", "HOT_LOAD_STATE_IN_PROGRESS"), ("e-0", "HOT_LOAD_STATE_COMPLETED")])
        await f.client.get_workflow_handle(names.hot_load_workflow_id(ORG, "e-1")).terminate(reason="operator")
        await until([("e-1", "HOT_LOAD_STATE_FAILED"), ("e-0", "HOT_LOAD_STATE_COMPLETED")])


async def test_an_open_hot_load_read_while_temporal_is_late_answers_what_it_kept(temporal_env, tmp_path):
    """api/open_reads.py on the real server, with every describe "late" (`wait_s` 0): a read
    is answered from the last describe while its own finishes in the background, so the end of
    a hot-load still shows (COMPLETED, its entries READY) from the describes the reads started;
    after a cancel through the API the next read waits for a describe of its own."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        reads = f.app.state.resources.open_reads
        reads.wait_s, reads.max_stale_s = 0.0, 3600.0
        dep = await f.ready_deployment()
        write_full(f.bucket_root / f"ckpt/{dep}", "s0")
        f.apply_behaviour = every(f.held)
        assert (await f.create_hot_load(dep, "s0", hotLoadId="polled")).status_code == 200
        await asyncio.wait_for(f.started.wait(), 30)
        hl = (await f.call("GET", "/hotLoads/polled")).json()["hotLoad"]  # nothing kept yet: waited for
        assert hl["status"]["state"] == "HOT_LOAD_STATE_IN_PROGRESS"
        # Temporal late for certain: each describe from here waits until `late` is set (with
        # wait_s 0, one that came back within a read's own event-loop turn was taken instead).
        late, describe = asyncio.Event(), reads.index.read

        async def late_read(*args, **kwargs):
            await late.wait()
            return await describe(*args, **kwargs)

        reads.index.read = late_read
        kept = reads.kept_answers
        for _ in range(4):
            hl = (await f.call("GET", "/hotLoads/polled")).json()["hotLoad"]
            assert hl["status"]["state"] == "HOT_LOAD_STATE_IN_PROGRESS"
        assert reads.kept_answers == kept + 4  # the premise: answered from what was kept, not waited for
        reads.index.read = describe
        late.set()
        f.hold.set()
        hl = await f.wait_hot_load("polled", timeout=30)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        assert {r["state"] for r in await f.hot_load_replicas("polled")} == {"READY"}
        await f.wait_idle(dep)

        f.hold.clear()
        f.started.clear()
        f.app.state.cancel_wait_s = 0  # the cancel answers at once
        assert (await f.create_hot_load(dep, "s0", hotLoadId="canceled")).status_code == 200
        await asyncio.wait_for(f.started.wait(), 30)
        await f.call("GET", "/hotLoads/canceled")
        kept = reads.kept_answers
        await f.call("GET", "/hotLoads/canceled")
        assert reads.kept_answers == kept + 1
        assert (await f.call("POST", "/hotLoads/canceled:cancel", json={})).status_code == 200
        await f.call("GET", "/hotLoads/canceled")
        assert reads.kept_answers == kept + 1  # the cancel dropped the kept answer: waited for a describe
        hl = await f.wait_hot_load("canceled", timeout=30)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_CANCELED"
