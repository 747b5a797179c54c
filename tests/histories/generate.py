"""Regenerates the exported histories replayed by tests/ops/test_history_check.py.

    .venv/bin/python -m tests.histories.generate

Runs the real workflows on a fresh Temporal dev server with the test replicas of
tests/helpers/harness.py and drives, through the API, one hot-load per path of the walk on a
3-replica deployment `history-dep`:

- `history-completed`: a full snapshot; the first replica from the bucket, then the broadcast
  after its commit, each receiver committing its stage;
- `history-early-completed`: a delta; the first replica offers from its checked stage, before
  its swap;
- `history-failed`: every replica's update fails (the workflow fails);
- `history-canceled`: canceled mid-step (the workflow is canceled);
- `history-crash-recovered`: a hot-load whose control worker is killed -9 mid-walk and restarted
  (its workflow tasks time out and are replayed on the new worker);
- the deployment `history-dep` that admitted the first four.

Each is exported with the Temporal CLI exactly as an operator would (`temporal workflow show -w
ID -o json`), one file per workflow named by its id (`/` as `%2F`). Files whose names hold
`previous-version` are kept, not regenerated: histories recorded by a release, kept beside the
workflow patch they need after it (control/patches.py; none at 0.1.0, CHANGELOG.md).

Regenerate when a workflow change is meant to be incompatible with running histories (hot-loads
are drained before an upgrade, docs/operations.md; a deployment's history needs a patch instead);
`make test` replays these files to catch accidental nondeterminism.
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
from tests.helpers.harness import ORG, ZONE, Fleet, write_full
from tests.helpers.temporal_server import TEMPORAL_BIN
from tests.helpers.workflow_checks import delta_body, deployment_state, every, kill9, start_control_process

HERE = Path(__file__).resolve().parent
# The hot-loads of `history-dep`, in the order they run.
HOT_LOADS = ("history-completed", "history-early-completed", "history-failed", "history-canceled")


def hot_load(hot_load_id: str) -> str:
    """The workflow id of the test organization's hot-load (contracts/names.py)."""
    return names.hot_load_workflow_id(ORG, hot_load_id)


def export(address: str, workflow_id: str) -> None:
    out = subprocess.run(
        [str(TEMPORAL_BIN), "workflow", "show", "-w", workflow_id, "-o", "json", "--address", address],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (HERE / f"{quote(workflow_id, safe='')}.json").write_text(out)
    print(f"wrote {quote(workflow_id, safe='')}.json ({len(out)} bytes)")


async def walk_paths(address: str, f: Fleet) -> None:
    """The completed (broadcast after the commit, early offer), failed and canceled hot-loads."""
    dep = await f.ready_deployment("history-dep", replicas=3)
    root = f.bucket_root / f"ckpt/{dep}"
    await f.completed(dep, "step-1", hotLoadId="history-completed")
    assert "offered" not in {e for _, e in f.peer_events}, "a full snapshot has no early offer"
    f.peer_events.clear()
    await f.completed(dep, "step-2", hotLoadId="history-early-completed", **delta_body("step-1"))
    assert any(e == "offered" for _, e in f.peer_events), "the delta was offered from the first stage"
    f.apply_behaviour = every(f.broken)
    write_full(root, "step-3")
    assert (await f.create_hot_load(dep, "step-3", hotLoadId="history-failed")).status_code == 200
    assert (await f.wait_hot_load("history-failed"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
    await f.wait_idle(dep)
    f.apply_behaviour = every(f.held)
    assert (await f.create_hot_load(dep, "step-3", hotLoadId="history-canceled")).status_code == 200
    await asyncio.wait_for(f.started.wait(), 30)
    await f.call("POST", "/hotLoads/history-canceled:cancel", json={})
    assert (await f.wait_hot_load("history-canceled"))["status"]["state"] == "HOT_LOAD_STATE_CANCELED"
    await f.wait_idle(dep)
    for hot_load_id in HOT_LOADS:
        export(address, hot_load(hot_load_id))
    export(address, names.deployment_workflow_id(ORG, dep))


async def crash_recovered(env: WorkflowEnvironment, address: str, tmp: Path) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    async with Fleet(env.client, tmp, control_worker=False) as f:
        proc = await start_control_process(address, f, tmp)
        try:
            state = deployment_state("history-crash", zones=[ZONE])
            state.replicas = f.replica_endpoints("history-crash", 3)
            dep = await f.deployment_from_state(state)
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


async def main() -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL_BIN),
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES],
        data_converter=pydantic_data_converter,
    )
    address = env.client.service_client.config.target_host
    try:
        for stale in HERE.glob("*.json"):
            if "previous-version" not in stale.name:
                stale.unlink()
        with tempfile.TemporaryDirectory() as tmp:
            async with Fleet(env.client, Path(tmp) / "walk") as f:
                await walk_paths(address, f)
            await crash_recovered(env, address, Path(tmp) / "crash")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
