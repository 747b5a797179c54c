"""Regenerates the exported histories replayed by tests/ops/test_history_check.py.

    .venv/bin/python -m tests.histories.generate

Runs the real workflows on a fresh Temporal dev server with the test replicas of
tests/helpers/harness.py, drives a completed, a failed and a canceled hot-load through the
API, then one whose control worker is killed -9 mid-walk and restarted (a crash-recovered
history: its workflow tasks time out and are replayed on the new worker), then a 3-replica
hot-load on the broadcast walk with pipelined commits (`... generate broadcast` writes only
that one; the others predate the broadcast or its pipelining and replay their unpatched
branches), then a completed and a failed delta hot-load whose first replica broadcasts from its
stage (`... generate early`), and exports each
workflow's history with the Temporal CLI exactly as an operator would
(`temporal workflow show -w ID -o json`), one file per workflow named by its id (`/` as `%2F`).
The files from before org-scoped workflow ids (`hotLoads/ORG/ID`, `deployments/ORG/ID`) are
named by the bare ids of then and replay the deployment's unpatched `org-scoped-ids` branch.

Regenerate only when a workflow change is meant to be incompatible with histories already
running (and then version it: `workflow.patched`), since `make test` replays these files to
catch accidental nondeterminism.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from common.settings import SEARCH_ATTRIBUTES
from contracts import names
from tests.helpers.harness import ORG, Fleet, write_full
from tests.helpers.temporal_server import TEMPORAL_BIN
from tests.helpers.workflow_checks import every

HERE = Path(__file__).resolve().parent


def hot_load(hot_load_id: str) -> str:
    """The workflow id of the test organization's hot-load (contracts/names.py)."""
    return names.hot_load_workflow_id(ORG, hot_load_id)


def export(address: str, workflow_id: str) -> None:
    out = subprocess.run(
        [str(TEMPORAL_BIN), "workflow", "show", "-w", workflow_id, "-o", "json", "--address", address],
        check=True, capture_output=True, text=True,
    ).stdout
    (HERE / f"{quote(workflow_id, safe='')}.json").write_text(out)
    print(f"wrote {quote(workflow_id, safe='')}.json ({len(out)} bytes)")


async def _deployment(f: Fleet, name: str, replicas: int = 3) -> str:
    """A ready deployment `name` of `replicas` test replicas in one zone; returns its id."""
    from tests.helpers.harness import ZONE
    from tests.helpers.workflow_checks import deployment_state

    state = deployment_state(name, zones=[ZONE])
    state.replicas = f.replica_endpoints(name, replicas)
    return await f.deployment_from_state(state)


async def crash_recovered(env: WorkflowEnvironment, address: str, tmp: Path) -> None:
    from tests.helpers.workflow_checks import kill9, start_control_process

    tmp.mkdir(parents=True, exist_ok=True)
    async with Fleet(env.client, tmp, control_worker=False) as f:
        proc = await start_control_process(address, f, tmp)
        try:
            dep = await _deployment(f, "history-crash")
            write_full(f.bucket_root / f"ckpt/{dep}", "step-1")
            f.apply_behaviour = {"replica-1": f.held}
            assert (await f.create_hot_load(dep, "step-1", hotLoadId="history-crash-recovered")).status_code == 200
            await asyncio.wait_for(f.started.wait(), 20)
            kill9(proc)
            f.hold.set()
            await asyncio.sleep(1)
            proc = await start_control_process(address, f, tmp)
            end = await f.wait_hot_load("history-crash-recovered", timeout=60)
            assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
            export(address, hot_load("history-crash-recovered"))
        finally:
            kill9(proc)


async def broadcast_walk(env: WorkflowEnvironment, address: str, tmp: Path, name: str = "history-pipelined") -> None:
    """A 3-replica hot-load on the broadcast walk: the first replica from the bucket, one
    broadcast to the other two, then a commit per receiver as soon as its stage is ready
    (`history-pipelined-completed`; `history-broadcast-completed` is the same walk from before
    `pipelined-commits`, when every stage was awaited first)."""
    tmp.mkdir(parents=True, exist_ok=True)
    async with Fleet(env.client, tmp) as f:
        dep = await _deployment(f, name)
        await f.completed(dep, "step-1", hotLoadId=f"{name}-completed")
        export(address, hot_load(f"{name}-completed"))


async def early_broadcast(env: WorkflowEnvironment, address: str, tmp: Path, name: str = "history-early") -> None:
    """Two delta hot-loads of a 3-replica deployment on "base" where the first replica offers
    the delta's files from its stage, before its swap (patched `early-broadcast`): one
    completes (`history-early-completed`); in the other the first replica's swap fails after
    both receivers staged, and the broadcast is abandoned (`history-early-failed`)."""
    from temporalio.exceptions import ApplicationError

    from tests.helpers.harness import write_delta

    delta = {"type": "SNAPSHOT_TYPE_INCREMENTAL", "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "base"}}
    tmp.mkdir(parents=True, exist_ok=True)
    async with Fleet(env.client, tmp) as f:
        dep = await _deployment(f, name)
        await f.completed(dep, "base", hotLoadId=f"{name}-base")
        f.peer_events.clear()

        async def swap_fails(replica: str) -> None:
            while sum(1 for _, e in f.peer_events if e == "staged") < 2:
                await asyncio.sleep(0.05)
            raise ApplicationError("engine: load_weights failed; it serves its previous weights", non_retryable=True)

        f.swap_behaviour = {"replica-0": swap_fails}
        write_delta(f.bucket_root / f"ckpt/{dep}", "step-1", "base")
        assert (await f.create_hot_load(dep, "step-1", hotLoadId=f"{name}-failed", **delta)).status_code == 200
        assert (await f.wait_hot_load(f"{name}-failed"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        await f.wait_idle(dep)
        f.swap_behaviour = {}
        await f.completed(dep, "step-1", hotLoadId=f"{name}-completed", **delta)
        for outcome in ("completed", "failed"):
            export(address, hot_load(f"{name}-{outcome}"))


async def main(only: list[str]) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL_BIN),
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES],
        data_converter=pydantic_data_converter,
    )
    address = env.client.service_client.config.target_host
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if only:
                if "broadcast" in only:
                    await broadcast_walk(env, address, Path(tmp) / "broadcast")
                if "early" in only:
                    await early_broadcast(env, address, Path(tmp) / "early")
                return
            async with Fleet(env.client, Path(tmp)) as f:
                dep = await f.ready_deployment("history-dep")
                root = f.bucket_root / f"ckpt/{dep}"
                await f.completed(dep, "step-1", hotLoadId="history-completed")
                f.apply_behaviour = every(f.broken)
                write_full(root, "step-2")
                assert (await f.create_hot_load(dep, "step-2", hotLoadId="history-failed")).status_code == 200
                assert (await f.wait_hot_load("history-failed"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
                await f.wait_idle(dep)
                f.apply_behaviour = every(f.held)
                assert (await f.create_hot_load(dep, "step-2", hotLoadId="history-canceled")).status_code == 200
                await asyncio.wait_for(f.started.wait(), 30)
                await f.call("POST", "/hotLoads/history-canceled:cancel", json={})
                assert (await f.wait_hot_load("history-canceled"))["status"]["state"] == "HOT_LOAD_STATE_CANCELED"
                await f.wait_idle(dep)
                for hot_load_id in ("history-completed", "history-failed", "history-canceled"):
                    export(address, hot_load(hot_load_id))
                export(address, names.deployment_workflow_id(ORG, dep))
            await crash_recovered(env, address, Path(tmp) / "crash")
            await broadcast_walk(env, address, Path(tmp) / "broadcast")
            await early_broadcast(env, address, Path(tmp) / "early")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    import sys

    # `... generate broadcast` writes only the pipelined broadcast walk's history; `... generate
    # early` only the two early-broadcast ones.
    asyncio.run(main(sys.argv[1:]))
