"""control/metrics.py: workflow code records through Temporal's workflow metric meter, the
control worker's runtime buffers it, and `TemporalMirror` answers it in Prometheus' names and
labels; a replay of the same history records nothing (the real dev server, a real worker and
Temporal's Replayer, with the buffered runtime the control worker uses)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from control import metrics


@workflow.defn(sandboxed=False)
class Records:
    @workflow.run
    async def run(self) -> None:
        metrics.hot_load_ended("FAILED", "ReplicaFailed", 12.5, ["checksum mismatch: w1", "replica-2 did not stage"])
        await workflow.sleep(timedelta(milliseconds=10))  # a second workflow task, replayed too
        metrics.scaled("out", "joined")


def _values(mirror: metrics.TemporalMirror) -> dict[tuple[str, tuple[str, ...]], float]:
    out = {}
    for family in mirror.collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_workflow_metrics_reach_prometheus_once_and_not_on_replay(temporal_env):
    runtime, buffer = metrics.buffered_runtime()
    target = temporal_env.client.service_client.config.target_host
    client = await Client.connect(
        target, namespace=temporal_env.client.namespace, runtime=runtime, data_converter=pydantic_data_converter
    )
    mirror = metrics.TemporalMirror(buffer)
    queue = f"metrics-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Records]):
        handle = await client.start_workflow(Records.run, id=f"metrics-{uuid.uuid4().hex}", task_queue=queue)
        await handle.result()
    got = _values(mirror)
    assert got[("rollouts_hot_loads_ended_total", (("outcome", "FAILED"), ("reason", "ReplicaFailed")))] == 1
    assert got[("rollouts_hot_load_duration_seconds_count", (("outcome", "FAILED"),))] == 1
    assert got[("rollouts_hot_load_duration_seconds_sum", (("outcome", "FAILED"),))] == 12.5
    assert got[("rollouts_hot_load_duration_seconds_bucket", (("le", "10.0"), ("outcome", "FAILED")))] == 0
    assert got[("rollouts_hot_load_duration_seconds_bucket", (("le", "30.0"), ("outcome", "FAILED")))] == 1
    assert got[("rollouts_hot_load_replica_failures_total", (("reason", "checksum mismatch"),))] == 1
    assert got[("rollouts_hot_load_replica_failures_total", (("reason", "replica-2 did not stage"),))] == 1
    assert got[("rollouts_autoscaling_steps_total", (("direction", "out"), ("outcome", "joined")))] == 1

    # The same history replayed (as after a worker restart) on the same runtime: nothing more.
    history = await handle.fetch_history()
    await Replayer(workflows=[Records], runtime=runtime, data_converter=pydantic_data_converter).replay_workflow(
        history
    )
    assert _values(mirror) == got


def test_the_mirror_keeps_only_our_metrics_and_labels():
    class Update:
        def __init__(self, name, value, attributes):
            self.metric = type("M", (), {"name": name})()
            self.value, self.attributes = value, attributes

    mirror = metrics.TemporalMirror()
    mirror.mirror(
        [
            Update(
                "rollouts_hot_loads_ended",
                1,
                {
                    "outcome": "COMPLETED",
                    "reason": "",
                    "namespace": "default",
                    "task_queue": "q",
                    "workflow_type": "HotLoadWorkflow",
                },
            ),
            Update("rollouts_hot_loads_ended", 2, {"outcome": "COMPLETED", "reason": ""}),
            Update("temporal_workflow_completed", 1, {}),  # the SDK's own: not mirrored
        ]
    )
    got = _values(mirror)
    assert got == {("rollouts_hot_loads_ended_total", (("outcome", "COMPLETED"), ("reason", ""))): 3}
