"""replica/agent/activities.py's `replica_step` and `heartbeating`, unit, on a stand-in runtime
(the lock and the cancel flag are all the step reads of it): the step heartbeats while it runs and
stops after; a cancel mid-step waits for the step and reports its result (`step_canceled` set);
a bad snapshot becomes a non-retryable error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from temporalio.exceptions import ApplicationError

from contracts.errors import NON_RETRYABLE_SNAPSHOT
from replica.agent import activities
from snapshots.errors import SnapshotError


@pytest.fixture
def beats(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    out: list[int] = []
    monkeypatch.setattr(activities.activity, "heartbeat", lambda *a: out.append(1))
    return out


def runtime() -> SimpleNamespace:
    return SimpleNamespace(lock=asyncio.Lock(), step_canceled=asyncio.Event())


async def test_heartbeating_beats_while_the_block_runs_and_stops_after(beats: list[int]) -> None:
    async with activities.heartbeating(every=0):
        for _ in range(5):
            await asyncio.sleep(0)
    during = len(beats)
    assert during >= 2
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(beats) == during


async def test_a_cancel_mid_step_waits_for_the_step_and_reports_it(beats: list[int]) -> None:
    rt, release = runtime(), asyncio.Event()

    async def step() -> str:
        await release.wait()
        return "served"

    task = asyncio.ensure_future(activities.replica_step(rt, step))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    assert rt.step_canceled.is_set() and not task.done()
    release.set()
    assert await task == "served"
    assert beats and not rt.lock.locked()


async def test_a_bad_snapshot_is_a_non_retryable_error(beats: list[int]) -> None:
    async def step() -> None:
        raise SnapshotError("tensor w: Adler-32 mismatch")

    with pytest.raises(ApplicationError) as err:
        await activities.replica_step(runtime(), step)
    assert err.value.type == NON_RETRYABLE_SNAPSHOT and err.value.non_retryable
