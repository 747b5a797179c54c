"""One trace per hot-load: the API request's span is the root, and the deployment's Update, the
hot-load workflow, the snapshot check and every replica step join it (temporalio's
TracingInterceptor on the client, inherited by the workers). Read with the SDK's in-memory
exporter, on the real Temporal dev server."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from common.telemetry import temporal_interceptors
from contracts.names import hot_load_workflow_id
from tests.helpers.harness import ORG, Fleet


async def test_one_trace_from_the_api_request_to_the_replica_steps(temporal_env, tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    client = await Client.connect(
        temporal_env.client.service_client.config.target_host,
        data_converter=pydantic_data_converter,
        interceptors=temporal_interceptors(tracer),
    )
    async with Fleet(client, tmp_path, tracer=tracer) as f:
        dep = await f.ready_deployment()
        exporter.clear()
        hl = await f.completed(dep, "s1", hotLoadId="traced")
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        await client.get_workflow_handle(
            hot_load_workflow_id(ORG, "traced")
        ).result()  # memo says COMPLETED a step earlier
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "POST /v1alpha1/inference/hotLoads"]
    assert root.parent is None and root.attributes["http.response.status_code"] == 200
    in_trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    names = {s.name for s in in_trace}
    for expected in (
        "StartWorkflowUpdate:create_hot_load",
        "RunActivity:check_snapshot_files",
        "StartChildWorkflow:HotLoadWorkflow",
        "RunWorkflow:HotLoadWorkflow",
        "CompleteWorkflow:HotLoadWorkflow",
    ):
        assert expected in names, sorted(names)
    # The Update is handled inside the deployment's long-lived trace, linked to this request.
    (handled,) = [s for s in spans if s.name == "HandleUpdate:create_hot_load"]
    assert any(link.context.trace_id == root.context.trace_id for link in handled.links)
    # One weight-changing step per replica: the first from the bucket, the other a broadcast
    # stage then its commit.
    steps = [s for s in in_trace if s.name in ("RunActivity:apply_snapshot", "RunActivity:commit_peer_stage")]
    assert len(steps) == 2, sorted(names)
    assert {"RunActivity:send_to_peers", "RunActivity:stage_from_peer"} <= names, sorted(names)
    # The polling GETs are traces of their own, not part of the operation's.
    assert all(s.name != "GET /v1alpha1/inference/hotLoads/{hot_load_id}" for s in in_trace)
