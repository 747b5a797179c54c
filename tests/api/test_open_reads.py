"""Reads of an open hot-load from a recent describe (api/open_reads.py), against a fake index
whose describes the test releases one by one and a clock the test moves: a fresh answer costs no
describe, an aging one is answered and refreshed behind the read (once, however many read), a
too-old one waits for a describe, a cancel's `forget` makes the next read describe, a failed
refresh is answered from what is kept until that is too old, a closed operation is not kept, and
replica entries older than what the index holds are described again; the close of the workflow
is described at once, and nobody reading ends the wait for it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.service import RPCError, RPCStatusCode

from api.listing import Record
from api.open_reads import OpenReads

WF = "hotLoads/org-a/h1"


def record(version: int, *, closed: bool = False, replicas: list[dict[str, Any]] | None = None) -> Record:
    updated = f"2026-12-03T00:00:{version:02d}Z"
    return Record(id=WF, key=("2026-12-03T00:00:00Z", WF), organization_id="org-a", deployment_id="d",
                  closed=closed, updated_at=updated, hot_load={"status": {"updatedAt": updated}},
                  replicas=replicas or [], json=b"{}")


class FakeIndex:
    """Describes answer the next of `answers` once the test releases them (`gate`)."""

    def __init__(self) -> None:
        self.answers: list[Record | None | Exception] = []
        self.gate = asyncio.Semaphore(0)
        self.calls: list[tuple[str, bool]] = []
        self.known: Record | None = None

    async def read(self, workflow_id: str, *, replicas: bool) -> Record | None:
        self.calls.append((workflow_id, replicas))
        await self.gate.acquire()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def latest(self, rec: Record) -> Record:
        cur = self.known
        return cur if cur is not None and cur.updated_at > rec.updated_at else rec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def closed() -> asyncio.Event:
    """Set: the hot-load's workflow closed (what the long poll waits for)."""
    return asyncio.Event()


@pytest.fixture
async def setup(closed: asyncio.Event):
    index, clock = FakeIndex(), Clock()

    async def closes(workflow_id: str) -> None:
        await closed.wait()

    reads = OpenReads(index, revalidate_s=0.25, max_stale_s=2.0, clock=clock, closes=closes)  # type: ignore[arg-type]
    yield index, clock, reads
    await reads.close()


async def answer(index: FakeIndex, *answers: Record | None | Exception) -> None:
    index.answers += answers
    for _ in answers:
        index.gate.release()
    await asyncio.sleep(0)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fresh_answers_cost_no_describe_and_aging_ones_refresh_once(setup):
    index, clock, reads = setup
    first = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    assert len(index.calls) == 1 and not first.done()  # the first read waits for its describe
    await answer(index, record(1))
    assert (await first).updated_at.endswith("01Z")
    clock.now += 0.2
    assert (await reads.read(WF, replicas=False)).updated_at.endswith("01Z")
    assert len(index.calls) == 1  # fresh: from memory
    clock.now += 0.1  # 0.3 s old: answered at once, refreshed behind the read, once for many reads
    for _ in range(5):
        assert (await reads.read(WF, replicas=False)).updated_at.endswith("01Z")
    await settle()
    assert len(index.calls) == 2
    await answer(index, record(2))
    await settle()
    assert (await reads.read(WF, replicas=False)).updated_at.endswith("02Z")
    assert len(index.calls) == 2 and reads.describes == 2


async def test_too_old_waits_for_a_describe(setup):
    index, clock, reads = setup
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    clock.now += 2.5
    late = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    assert not late.done(), "an answer older than max_stale_s was given"
    await answer(index, record(2))
    assert (await late).updated_at.endswith("02Z")


async def test_forget_makes_the_next_read_describe_and_an_older_describe_lands_nowhere(setup):
    index, clock, reads = setup
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    clock.now += 0.3
    await reads.read(WF, replicas=False)  # starts a refresh; it is still in flight at the forget
    await settle()
    assert len(index.calls) == 2
    reads.forget(WF)
    after = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    assert len(index.calls) == 3 and not after.done()  # its own describe, not the older one's
    await answer(index, record(2))  # the refresh started before the forget
    await settle()
    assert not after.done()
    await answer(index, record(3))
    assert (await after).updated_at.endswith("03Z")
    assert (await reads.read(WF, replicas=False)).updated_at.endswith("03Z")


async def test_a_failed_refresh_is_answered_from_what_is_kept_until_too_old(setup):
    index, clock, reads = setup
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    clock.now += 0.5
    await reads.read(WF, replicas=False)
    await answer(index, RPCError("down", RPCStatusCode.UNAVAILABLE, b""))
    await settle()
    assert (await reads.read(WF, replicas=False)).updated_at.endswith("01Z")
    clock.now += 2.0
    late = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    await answer(index, RPCError("down", RPCStatusCode.UNAVAILABLE, b""))
    with pytest.raises(RPCError):
        await late


async def test_closed_and_missing_operations_are_not_kept(setup):
    index, clock, reads = setup
    await answer(index, record(1, closed=True))
    assert (await reads.read(WF, replicas=False)).closed
    again = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    assert len(index.calls) == 2  # not answered from here: the index answers closed ones
    await answer(index, None)
    assert await again is None
    nothing = asyncio.create_task(reads.read(WF, replicas=False))
    await settle()
    assert len(index.calls) == 3
    await answer(index, None)
    assert await nothing is None


async def test_entries_older_than_what_the_index_holds_are_described_again(setup):
    index, clock, reads = setup
    await answer(index, record(1, replicas=[{"name": "r0", "state": "UPDATING"}]))
    await reads.read(WF, replicas=True)
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    index.known = record(2)  # e.g. a GET of the operation alone, or a listing, saw a newer state
    assert (await reads.read(WF, replicas=False)).updated_at.endswith("02Z")  # the operation: the index's
    entries = asyncio.create_task(reads.read(WF, replicas=True))
    await settle()
    assert not entries.done(), "replica entries older than an answer already given were served"
    await answer(index, record(2, replicas=[{"name": "r0", "state": "READY"}]))
    assert (await entries).replicas == [{"name": "r0", "state": "READY"}]


async def test_the_close_is_described_at_once_and_nothing_of_it_is_kept(setup, closed) -> None:
    index, clock, reads = setup
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    await answer(index, record(1, replicas=[{"name": "r0", "state": "UPDATING"}]))
    await reads.read(WF, replicas=True)
    assert len(index.calls) == 2
    closed.set()  # the workflow ends; no read comes, no time passes
    await settle()
    assert index.calls[-1] == (WF, False) and len(index.calls) == 3  # described at once
    await answer(index, record(2, closed=True))
    await settle()
    assert reads._kept == {} and reads._watches == {}  # the index answers it from now on


async def test_the_wait_for_the_close_ends_when_nobody_reads(setup) -> None:
    index, clock, reads = setup
    reads.watch_s = 0.02
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    assert WF in reads._watches
    await asyncio.sleep(0.05)
    assert WF in reads._watches  # read within watch_s (the clock has not moved)
    clock.now += 1.0
    await asyncio.sleep(0.1)
    assert WF not in reads._watches and len(index.calls) == 1
