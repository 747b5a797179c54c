"""A workflow that continues as new hands its next run the memo as it stands (control/deployment.py,
control/nodes.py): Temporal starts the new run with the memo its continue-as-new gives (without
one, the first run's start memo: a deployment CREATING with no replicas), and the API and every
gateway read that memo until the new run's first upsert. A deployment also hands over the load
reports it heard (control/autoscaler.py), so an autoscaling step does not wait for the next one.

Its own dev server, which suggests continue-as-new after a few events, so a deployment does it
within a couple of hot-loads.
"""

from __future__ import annotations

import pytest
from temporalio.api.enums.v1 import EventType

from contracts import names
from contracts.autoscaling import STEADY, LoadReport
from contracts.memo import replica_list
from tests.helpers.harness import Fleet, poll
from tests.helpers.temporal_server import start_dev_server

SUGGEST_AFTER_EVENTS = 60


@pytest.fixture(scope="module")
async def short_history_env():
    env = await start_dev_server("--dynamic-config-value",
                                 f"limit.historyCount.suggestContinueAsNew={SUGGEST_AFTER_EVENTS}")
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
        started = None
        async for event in f.client.get_workflow_handle(handle.id, run_id=new_run).fetch_history_events():
            assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
            started = event.workflow_execution_started_event_attributes
            break
        assert started is not None
        converter = f.client.data_converter.payload_converter
        memo = {k: converter.from_payload(v) for k, v in started.memo.fields.items()}
        # What the new run starts with: the deployment as the old run last published it.
        assert memo["deployment"]["status"]["status"] == "STATUS_READY", memo["deployment"]["status"]
        assert memo["deployment"]["status"]["readyReplicas"] == 2
        assert memo["deployment"]["status"]["currentSnapshotIdentity"] == "s1"
        state = await f.deployment_state(dep)
        assert sorted(r["name"] for r in replica_list(memo)) == sorted(r.name for r in state.replicas)
        assert {g: h.level for g, h in state.load_heard.items()} == {"gw-heard": STEADY}
