"""A workflow that continues as new hands its next run the memo as it stands (control/deployment.py,
control/nodes.py): Temporal starts the new run with the memo its continue-as-new gives (without
one, the first run's start memo: a deployment CREATING with no replicas), and the API and every
gateway read that memo until the new run's first upsert. A deployment also hands over the load
reports it heard (control/autoscaler.py), so an autoscaling step does not wait for the next one.

Its own dev server, which suggests continue-as-new after a few events, so a deployment does it
within a couple of hot-loads.
"""

from __future__ import annotations

import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from contracts import names
from contracts.autoscaling import STEADY, LoadReport
from contracts.memo import replica_list
from contracts.nodes import NodeHeartbeat, RegistryState
from control.nodes import NodeRegistryWorkflow
from tests.helpers.harness import Fleet, poll
from tests.helpers.temporal_server import start_dev_server

SUGGEST_AFTER_EVENTS = 60


async def start_memo(client: Client, handle: WorkflowHandle, run_id: str) -> dict:
    """The memo a run started with (its first event)."""
    async for event in client.get_workflow_handle(handle.id, run_id=run_id).fetch_history_events():
        assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        converter = client.data_converter.payload_converter
        fields = event.workflow_execution_started_event_attributes.memo.fields
        return {k: converter.from_payload(v) for k, v in fields.items()}
    raise AssertionError(f"run {run_id} of {handle.id} has no history")


@pytest.fixture(scope="module")
async def short_history_env():
    env = await start_dev_server(
        "--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGEST_AFTER_EVENTS}"
    )
    try:
        yield env
    finally:
        await env.shutdown()


async def test_a_deployment_continues_as_new_with_its_replicas_and_status_in_the_memo(short_history_env, tmp_path):
    async with Fleet(short_history_env.client, tmp_path) as f:
        dep = await f.ready_deployment(replicas=2)
        handle = f.deployment_handle(dep)
        first_run = (await handle.describe()).run_id
        await handle.signal(names.LOAD_REPORT, LoadReport(gateway_id="gw-heard", level=STEADY))
        await f.completed(dep, "s1")

        async def next_run() -> str | None:
            run = (await handle.describe()).run_id
            return run if run != first_run else None

        new_run = await poll(next_run, 60, "the deployment continued as new")
        memo = await start_memo(f.client, handle, new_run)
        # What the new run starts with: the deployment as the old run last published it.
        assert memo["deployment"]["status"]["status"] == "STATUS_READY", memo["deployment"]["status"]
        assert memo["deployment"]["status"]["readyReplicas"] == 2
        assert memo["deployment"]["status"]["currentSnapshotIdentity"] == "s1"
        state = await f.deployment_state(dep)
        assert sorted(r["name"] for r in replica_list(memo)) == sorted(r.name for r in state.replicas)
        assert {g: h.level for g, h in state.load_heard.items()} == {"gw-heard": STEADY}


async def test_the_node_registry_continues_as_new_with_its_nodes_in_the_memo(short_history_env):
    client = short_history_env.client
    task_queue = f"test-nodes-{uuid.uuid4().hex[:12]}"
    async with Worker(client, task_queue=task_queue, workflows=[NodeRegistryWorkflow]):
        handle = await client.start_workflow(
            NodeRegistryWorkflow.run,
            RegistryState(lost_after_s=600.0),
            id=f"test-registry-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        first_run = (await handle.describe()).run_id
        beats = [NodeHeartbeat(name=n, address=f"10.9.0.{i}", zone="Z1", slots=2) for i, n in enumerate(("n1", "n2"))]

        async def next_run() -> str | None:
            for hb in beats:  # each heartbeat adds to the history: continue-as-new comes soon
                await handle.signal(names.NODE_HEARTBEAT, hb)
            run = (await handle.describe()).run_id
            return run if run != first_run else None

        try:
            new_run = await poll(next_run, 60, "the node registry continued as new", every=0.1)
            memo = await start_memo(client, handle, new_run)
            # Without it, the first run's start memo: no node at all.
            assert sorted(memo["nodes"]) == ["n1", "n2"], memo
            assert memo["nodes"]["n2"]["heartbeat"]["slots"] == 2
        finally:
            await handle.terminate("test over")
