"""Each deployment's load as this gateway sees it, and its report to the deployment, which
autoscales on it (contracts/autoscaling.py: the judgement and the rule).

``LoadMeter``: a request counts from ``begin`` (routing) until its last byte (``track`` ends it
when the answer's body ends, however it ends). ``report_loop`` samples every ``SAMPLE_S`` each
autoscaling deployment this gateway serves, judges the last ``WINDOW_S`` against its serving
replicas and ``targetInFlight``, and signals (``temporal_signal``: its ``load_report``) on a
change and at least every ``HEARTBEAT_S``; a failed signal is logged and sent on the next sample.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from common.settings import temporal_client
from contracts import names
from contracts.autoscaling import HEARTBEAT_S, SAMPLE_S, WINDOW_S, LoadReport, judge
from gateway.routing import Router

log = logging.getLogger("rollouts.gateway.load")

Signal = Callable[[str, LoadReport], Awaitable[None]]


class LoadMeter:
    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}  # deployment workflow id -> requests

    def begin(self, workflow_id: str) -> None:
        self.in_flight[workflow_id] = self.in_flight.get(workflow_id, 0) + 1

    def end(self, workflow_id: str) -> None:
        left = self.in_flight.get(workflow_id, 1) - 1
        if left > 0:
            self.in_flight[workflow_id] = left
        else:
            self.in_flight.pop(workflow_id, None)

    def track(self, workflow_id: str, response: Response) -> Response:
        if not isinstance(response, StreamingResponse):
            self.end(workflow_id)
            return response
        body = response.body_iterator

        async def counted() -> AsyncIterator[Any]:
            try:
                async for part in body:
                    yield part
            finally:
                self.end(workflow_id)

        response.body_iterator = counted()
        return response


class Reporter:
    """The judging and reporting state of ``report_loop`` (one per gateway)."""

    def __init__(self, router: Router, meter: LoadMeter, signal: Signal) -> None:
        self.router, self.meter, self.signal = router, meter, signal
        self.samples: dict[str, deque[int]] = {}
        self.sent: dict[str, tuple[str, float]] = {}  # workflow id -> (level, when sent)

    async def sample(self, now: float) -> None:
        keep = math.ceil(WINDOW_S / SAMPLE_S)
        views = {wf: v for wf, v in self.router.views.items() if v.scales and self.router.serves(v)}
        for gone in set(self.samples) - set(views):
            self.samples.pop(gone, None)
            self.sent.pop(gone, None)
        for wf, view in views.items():
            window = self.samples.setdefault(wf, deque(maxlen=keep))
            window.append(self.meter.in_flight.get(wf, 0))
            if len(window) < keep:
                continue  # a whole window before the first judgement
            level = judge(list(window), len(view.replicas), view.target_in_flight)
            last = self.sent.get(wf)
            if last is not None and last[0] == level and now - last[1] < HEARTBEAT_S:
                continue
            report = LoadReport(
                gateway_id=self.router.gateway_id or "",
                level=level,
                mean_in_flight=round(sum(window) / len(window), 3),
                peak_in_flight=max(window),
                replicas=len(view.replicas),
            )
            try:
                await self.signal(wf, report)
            except Exception as exc:  # noqa: BLE001 - sent again on the next sample
                log.warning("load report to %s failed: %s", wf, exc)
                continue
            if last is None or last[0] != level:
                log.info(
                    "%s: %s (mean %.1f, peak %d in flight on %d replica(s))",
                    wf,
                    level,
                    report.mean_in_flight,
                    report.peak_in_flight,
                    report.replicas,
                )
            self.sent[wf] = (level, now)


def temporal_signal(settings: Any) -> Signal:
    client = None

    async def signal(workflow_id: str, report: LoadReport) -> None:
        nonlocal client
        if client is None:
            client = await temporal_client(settings)
        await client.get_workflow_handle(workflow_id).signal(names.LOAD_REPORT, report)

    return signal


async def report_loop(router: Router, meter: LoadMeter, signal: Signal) -> None:
    """Sample, judge and report until cancelled (module docstring)."""
    reporter = Reporter(router, meter, signal)
    while True:
        try:
            await reporter.sample(time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep reporting
            log.warning("load sampling failed: %s", exc)
        await asyncio.sleep(SAMPLE_S)
