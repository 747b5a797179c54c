"""A gateway's load reports (gateway/load.py): a request counts from its routing to its last
byte, however its stream ends; each autoscaled deployment's window is judged once full and
reported when the judgement changes and at every heartbeat; other deployments are not sampled."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from contracts.autoscaling import BUSY, HEARTBEAT_S, IDLE, SAMPLE_S, STEADY, WINDOW_S, LoadReport
from gateway.load import LoadMeter, Reporter
from gateway.routing import DeploymentView, ReplicaView, Router

WINDOW = int(WINDOW_S / SAMPLE_S)


def view(workflow_id: str, replicas: int, *, scales: bool = True) -> DeploymentView:
    return DeploymentView(
        deployment_id=workflow_id.rsplit("/", 1)[-1],
        model_name="m",
        workflow_id=workflow_id,
        engine_config={},
        organization_id="org",
        replicas=tuple(ReplicaView(f"r{i}", f"http://r{i}", "initial") for i in range(replicas)),
        gateway_ids=("gw",),
        scales=scales,
        target_in_flight=2,
    )


def test_a_streamed_answer_counts_until_its_body_ends_however_it_ends() -> None:
    meter = LoadMeter()

    async def body():
        yield b"a"
        raise RuntimeError("upstream broke")

    async def run() -> None:
        meter.begin("d")
        meter.begin("d")
        meter.track("d", JSONResponse({}))  # a plain answer ends at once
        assert meter.in_flight == {"d": 1}
        streamed = meter.track("d", StreamingResponse(body()))
        parts = streamed.body_iterator
        assert await anext(parts) == b"a" and meter.in_flight == {"d": 1}
        with pytest.raises(RuntimeError):
            await anext(parts)
        assert meter.in_flight == {}

    asyncio.run(run())


def test_reports_go_on_a_change_and_at_every_heartbeat_only_for_autoscaled_deployments() -> None:
    router = Router(gateway_id="gw")
    for v in (view("deployments/org/a", 2), view("deployments/org/fixed", 2, scales=False)):
        router.set_view(v)
    meter = LoadMeter()
    sent: list[tuple[str, LoadReport]] = []

    async def signal(wf: str, report: LoadReport) -> None:
        sent.append((wf, report))

    reporter = Reporter(router, meter, signal)

    async def run() -> None:
        for i in range(WINDOW - 1):
            await reporter.sample(float(i))
        assert sent == []  # not a whole window yet
        await reporter.sample(float(WINDOW))
        assert [(wf, r.level) for wf, r in sent] == [("deployments/org/a", IDLE)]
        for _ in range(5):  # a request in flight, then 4 (2 per replica: busy once the mean reaches it)
            meter.begin("deployments/org/a")
        meter.begin("deployments/org/fixed")
        t = float(WINDOW)
        while sent[-1][1].level != BUSY:
            t += 1
            await reporter.sample(t)
        levels = [r.level for _, r in sent]
        assert levels == [IDLE, STEADY, BUSY], levels
        assert sent[-1][1].gateway_id == "gw" and sent[-1][1].replicas == 2 and sent[-1][1].peak_in_flight == 5
        await reporter.sample(t + 1)
        assert len(sent) == 3  # unchanged: nothing until the heartbeat
        await reporter.sample(t + HEARTBEAT_S)
        assert len(sent) == 4 and sent[-1][1].level == BUSY
        assert all(wf == "deployments/org/a" for wf, _ in sent)

    asyncio.run(run())


def test_a_failed_signal_is_sent_again_on_the_next_sample() -> None:
    router = Router(gateway_id="gw")
    router.set_view(view("deployments/org/a", 1))
    calls: list[str] = []

    async def signal(wf: str, report: LoadReport) -> None:
        calls.append(report.level)
        if len(calls) == 1:
            raise RuntimeError("Temporal is restarting")

    reporter = Reporter(router, LoadMeter(), signal)

    async def run() -> None:
        for i in range(WINDOW + 1):
            await reporter.sample(float(i))

    asyncio.run(run())
    assert calls == [IDLE, IDLE]
