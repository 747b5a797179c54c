"""Reads of an open hot-load (api/open_reads.py), against a fake index whose describes the test
releases one by one and a clock the test moves: a describe in time is the answer, a late one is
replaced by the kept answer and kept for the next reads (one describe in flight however many
read), a too-old answer is not given, a cancel's `forget` makes the next read wait for a describe
of its own, a failed describe is replaced by what is kept until that is too old, a closed
operation is not kept, and replica entries older than what the index holds are waited for."""

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
    return Record(
        id=WF,
        key=("2026-12-03T00:00:00Z", WF),
        organization_id="org-a",
        deployment_id="d",
        closed=closed,
        updated_at=updated,
        hot_load={"status": {"updatedAt": updated}},
        replicas=replicas or [],
        json=b"{}",
    )


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
async def setup():
    index, clock = FakeIndex(), Clock()
    reads = OpenReads(index, wait_s=0.01, max_stale_s=2.0, clock=clock)  # type: ignore[arg-type]
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


async def kept_one(index: FakeIndex, reads: OpenReads) -> None:
    """A first read, answered in time by describe 1: what ``reads`` keeps from now on."""
    await answer(index, record(1))
    await reads.read(WF, replicas=False)


def version(rec: Record | None) -> int:
    assert rec is not None
    return int(rec.updated_at[-3:-1])


async def test_a_describe_in_time_is_the_answer_and_a_late_one_is_kept_for_the_next(setup) -> None:
    index, clock, reads = setup
    first = asyncio.create_task(reads.read(WF, replicas=False))
    await asyncio.sleep(0.05)
    assert not first.done()  # nothing kept: the first read waits for its describe, however long
    await answer(index, record(1))
    assert version(await first) == 1
    await answer(index, record(2))  # the next describe answers at once
    assert version(await reads.read(WF, replicas=False)) == 2 and reads.kept_answers == 0
    # A late describe: the kept answer, after wait_s; reads meanwhile join the same describe.
    assert [version(await reads.read(WF, replicas=False)) for _ in range(3)] == [2, 2, 2]
    assert reads.describes == 3 and reads.kept_answers == 3
    await answer(index, record(3))  # the late describe ends: kept for the next reads
    await settle()
    assert version(await reads.read(WF, replicas=False)) == 3  # its own describe is late: the kept one
    assert reads.describes == 4


async def test_too_old_is_not_given(setup) -> None:
    index, clock, reads = setup
    await kept_one(index, reads)
    clock.now += 2.5
    late = asyncio.create_task(reads.read(WF, replicas=False))
    await asyncio.sleep(0.05)
    assert not late.done(), "an answer older than max_stale_s was given"
    await answer(index, record(2))
    assert version(await late) == 2


async def test_after_forget_a_read_waits_for_a_describe_of_its_own(setup) -> None:
    index, clock, reads = setup
    await kept_one(index, reads)
    assert version(await reads.read(WF, replicas=False)) == 1  # kept; its describe is still in flight
    assert len(index.calls) == 2
    reads.forget(WF)
    after = asyncio.create_task(reads.read(WF, replicas=False))
    await asyncio.sleep(0.05)
    assert len(index.calls) == 3 and not after.done()  # not the older describe, and no kept answer
    await answer(index, record(2))  # the describe started before the forget
    await settle()
    assert not after.done()
    await answer(index, record(3))
    assert version(await after) == 3


async def test_a_failed_describe_is_replaced_by_what_is_kept_until_too_old(setup) -> None:
    index, clock, reads = setup
    await kept_one(index, reads)
    await answer(index, RPCError("down", RPCStatusCode.UNAVAILABLE, b""))
    assert version(await reads.read(WF, replicas=False)) == 1
    clock.now += 2.5
    await answer(index, RPCError("down", RPCStatusCode.UNAVAILABLE, b""))
    with pytest.raises(RPCError):
        await reads.read(WF, replicas=False)


async def test_closed_and_missing_operations_are_not_kept(setup) -> None:
    index, clock, reads = setup
    await answer(index, record(1, closed=True))
    assert (await reads.read(WF, replicas=False)).closed
    assert reads._kept == {}
    await answer(index, None)
    assert await reads.read(WF, replicas=False) is None
    assert reads._kept == {}


async def test_entries_older_than_a_state_already_answered_are_waited_for(setup) -> None:
    """An operation nobody lists is not in the index: what this process answered for it, in
    either view, is what a late describe's kept answer may not be older than (a trainer that read
    COMPLETED then reads the replicas)."""
    index, clock, reads = setup
    await answer(index, record(1, replicas=[{"name": "r0", "state": "UPDATING"}]))
    await reads.read(WF, replicas=True)
    await answer(index, record(2))
    assert version(await reads.read(WF, replicas=False)) == 2  # the operation alone, described in time
    entries = asyncio.create_task(reads.read(WF, replicas=True))
    await asyncio.sleep(0.05)
    assert not entries.done(), "replica entries older than a state already answered were served"
    await answer(index, record(2, replicas=[{"name": "r0", "state": "READY"}]))
    assert (await entries).replicas == [{"name": "r0", "state": "READY"}]
    # And the operation alone never goes back: a late describe answers the newest state answered.
    await answer(index, record(3, replicas=[{"name": "r0", "state": "READY"}]))
    await reads.read(WF, replicas=True)
    assert version(await reads.read(WF, replicas=False)) == 3


async def test_entries_older_than_what_the_index_holds_are_waited_for(setup) -> None:
    index, clock, reads = setup
    await answer(index, record(1, replicas=[{"name": "r0", "state": "UPDATING"}]))
    await reads.read(WF, replicas=True)
    await answer(index, record(1))
    await reads.read(WF, replicas=False)
    index.known = record(2)  # e.g. a GET of the operation alone, or a listing, saw a newer state
    assert version(await reads.read(WF, replicas=False)) == 2  # late describe: the index's answer
    entries = asyncio.create_task(reads.read(WF, replicas=True))
    await asyncio.sleep(0.05)
    assert not entries.done(), "replica entries older than an answer already given were served"
    await answer(index, record(2), record(2, replicas=[{"name": "r0", "state": "READY"}]))
    assert (await entries).replicas == [{"name": "r0", "state": "READY"}]
