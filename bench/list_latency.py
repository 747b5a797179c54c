"""Latency of the hot-load read endpoints with many operations in history; prints p50/p99.

    .venv/bin/python bench/list_latency.py [--hot-loads 500] [--requests 200]
                                           [--save FIGURES.json] [--baseline FIGURES.json]

Starts a Temporal dev server (in memory, our search attributes), runs the real hot-load workflow
with a stand-in replica step (2 replicas, ~10 % of operations FAILED), starts N hot-load
workflows for one deployment directly, then times the API in process (httpx's ASGI transport,
so HTTP parsing by uvicorn is not included) for:

    GET /hotLoads?parentDeploymentId=D&maxPageSize=50     (first page; what a dashboard polls)
    GET /hotLoads?parentDeploymentId=D&maxPageSize=1000   (what cwtrain sends)
    GET /hotLoads/{id}, GET /hotLoads/{id}/replicas
    GET /hotLoads?parentDeploymentId=D&maxPageSize=50 from 8 clients at once (a request's time
                                                          includes waiting behind the others)

`--save` writes the figures as JSON; `--baseline` reads such a file (e.g. saved by this bench run
on another commit) and prints each figure's ratio to it (baseline / this run: above 1 is faster).
The goal is a p99 under 50 ms with 500 hot-loads in history: this prints the figures; it is not
a test threshold (the machine is shared). Measured figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api.app import PREFIX, create_app  # noqa: E402
from common.settings import SEARCH_ATTRIBUTES, Settings  # noqa: E402
from contracts import names  # noqa: E402
from contracts.activities import ApplySnapshotInput, ApplySnapshotResult  # noqa: E402
from contracts.records import (  # noqa: E402
    HotLoad,
    HotLoadConfig,
    HotLoadInput,
    HotLoadSpec,
    HotLoadState,
    HotLoadStatus,
    ReplicaEndpoint,
    SnapshotRef,
    SnapshotType,
    rfc3339,
)
from contracts.search import hot_load_attributes  # noqa: E402
from contracts.tokens import add_token  # noqa: E402
from control.hot_load.workflow import HotLoadWorkflow  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEPLOYMENT = "bench-dep"


@activity.defn(name=names.APPLY_SNAPSHOT)
async def apply_snapshot(inp: ApplySnapshotInput) -> ApplySnapshotResult:
    if inp.identity.endswith("-fail"):
        raise ApplicationError("checksum mismatch (bench)", type="SnapshotError", non_retryable=True)
    return ApplySnapshotResult(
        identity=inp.identity, engine_pid=1, tensors_loaded=1, bytes_read_from_bucket=1, pause_ms=1
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def fill(client, task_queue: str, count: int) -> list[str]:
    replica_queue = f"{task_queue}/replica"
    replicas = [
        ReplicaEndpoint(
            name=f"replica-{i}",
            zone="LOCAL-1A",
            task_queue=replica_queue,
            engine_url="http://x",
            engine_pid=1,
            agent_pid=1,
            started_at="2026-01-01T00:00:00.000000Z",
        )
        for i in range(2)
    ]
    ids: list[str] = []
    sem = asyncio.Semaphore(25)

    async def one(i: int) -> None:
        hl_id = str(uuid.uuid4())
        identity = f"step-{i:06d}" + ("-fail" if i % 10 == 7 else "")
        now = rfc3339(__import__("datetime").datetime.now(__import__("datetime").UTC))
        hot_load = HotLoad(
            spec=HotLoadSpec(
                id=hl_id,
                deployment_id=DEPLOYMENT,
                organization_id="org-bench",
                identity=identity,
                type=SnapshotType.FULL,
                snapshot_chain=[SnapshotRef(identity=identity, type=SnapshotType.FULL, hot_load_id=hl_id)],
            ),
            status=HotLoadStatus(state=HotLoadState.PENDING, created_at=now, updated_at=now),
        )
        async with sem:
            handle = await client.start_workflow(
                HotLoadWorkflow.run,
                HotLoadInput(
                    hot_load=hot_load,
                    hot_load_config=HotLoadConfig(bucket="b", path_prefix="p"),
                    replicas=replicas,
                    deployment_workflow_id="deployments/absent",
                ),
                id=names.hot_load_workflow_id("org-bench", hl_id),
                task_queue=task_queue,
                search_attributes=hot_load_attributes(hot_load),
                memo={"hotLoad": hot_load.wire()},
            )
            try:
                await handle.result()
            except WorkflowFailureError:
                pass  # a FAILED hot-load is a failed workflow; the API reads its memo
        ids.append(hl_id)

    await asyncio.gather(*(one(i) for i in range(count)))
    return ids


async def timed(http: httpx.AsyncClient, path: str, n: int, **params) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await http.get(path, params=params)
        out.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, r.text
    return out


async def concurrent(http: httpx.AsyncClient, path: str, n: int, clients: int, **params) -> list[float]:
    per_client = await asyncio.gather(*(timed(http, path, max(1, n // clients), **params) for _ in range(clients)))
    return [ms for one in per_client for ms in one]


def report(rows: list[tuple[str, list[float]]], baseline: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    figures = {}
    for name, ms in rows:
        p50, p99 = statistics.median(ms), percentile(ms, 0.99)
        figures[name] = {"p50": p50, "p99": p99, "n": len(ms)}
        line = f"  {name:<26} p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   (n={len(ms)})"
        if name in baseline:
            was = baseline[name]
            line += (
                f"   baseline p50 {was['p50']:7.2f} p99 {was['p99']:7.2f}: "
                f"x{was['p50'] / p50:.1f} / x{was['p99'] / p99:.1f}"
            )
        print(line)
    return figures


def api_client(app, token: str = "bench") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url=f"http://api{PREFIX}",
        headers={"Authorization": f"Bearer {token}"},
    )


async def wait_listed(http: httpx.AsyncClient, count: int) -> None:
    """Visibility is eventually consistent: wait until every operation is listed closed."""
    while True:
        r = await http.get("/hotLoads", params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 1000})
        got = r.json()["hotLoads"]
        if len(got) == count and all(h["status"]["state"] != "HOT_LOAD_STATE_IN_PROGRESS" for h in got):
            return
        await asyncio.sleep(0.5)


async def cold_list_ms(settings: Settings, client, task_queue: str) -> float:
    """A fresh API process (empty cache) answers its first listing by loading it all."""
    cold_app = create_app(settings, temporal_client=client, task_queue=task_queue)
    async with cold_app.router.lifespan_context(cold_app), api_client(cold_app) as cold:
        return await timed(cold, "/hotLoads", 1, parentDeploymentId=DEPLOYMENT, maxPageSize=50)


async def read_rows(http: httpx.AsyncClient, ids: list[str], n: int, cold_ms: float) -> list:
    one = ids[len(ids) // 2]
    return [
        ("list, cold (1st request)", cold_ms),
        ("list, first page of 50", await timed(http, "/hotLoads", n, parentDeploymentId=DEPLOYMENT, maxPageSize=50)),
        (
            "list, 1000 per page",
            await timed(http, "/hotLoads", max(20, n // 4), parentDeploymentId=DEPLOYMENT, maxPageSize=1000),
        ),
        ("get one", await timed(http, f"/hotLoads/{one}", n)),
        ("replicas of one", await timed(http, f"/hotLoads/{one}/replicas", n)),
        (
            "list, 8 clients at once",
            await concurrent(http, "/hotLoads", n, 8, parentDeploymentId=DEPLOYMENT, maxPageSize=50),
        ),
    ]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hot-loads", type=int, default=500)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--save", type=Path, help="write the figures to this JSON file")
    ap.add_argument("--baseline", type=Path, help="figures saved by an earlier run: print ratios to them")
    args = ap.parse_args()
    baseline = json.loads(args.baseline.read_text()) if args.baseline else {}
    logging.basicConfig(level=logging.ERROR)

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(REPO / ".venv" / "bin" / "temporal"),
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES],
        data_converter=pydantic_data_converter,
    )
    task_queue = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        async with (
            Worker(env.client, task_queue=task_queue, workflows=[HotLoadWorkflow]),
            Worker(env.client, task_queue=f"{task_queue}/replica", activities=[apply_snapshot]),
        ):
            t0 = time.perf_counter()
            ids = await fill(env.client, task_queue, args.hot_loads)
            print(f"{len(ids)} hot-loads run in {time.perf_counter() - t0:.1f}s")
        # Reads need no worker: the workers are gone now, as after a restart.
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings.create(Path(tmp), 30000)
            add_token(settings.tokens_file, "bench", "viewer", "org-bench", "bench")
            app = create_app(settings, temporal_client=env.client, task_queue=task_queue)
            async with app.router.lifespan_context(app), api_client(app) as http:
                await wait_listed(http, len(ids))
                n = args.requests
                cold_ms = await cold_list_ms(settings, env.client, task_queue)
                rows = await read_rows(http, ids, n, cold_ms)
        index = app.state.resources.hot_loads
        print(
            f"{args.hot_loads} hot-loads in history, in-process ASGI, {n} requests each (visibility: "
            f"{index.full_loads} full reads, {getattr(index, 'refreshes', '?')} background refreshes):"
        )
        figures = report(rows, baseline)
        if args.save:
            args.save.write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
