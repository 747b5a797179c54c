"""Reads of an open hot-load by id, answered from a recent describe refreshed behind the reads.

Per open hot-load and per view (the operation alone, or with its replica entries), a read is
answered so:

* the describe behind the kept answer started at most `revalidate_s` ago: that answer, from memory;
* it started at most `max_stale_s` ago: that answer, from memory, and one describe starts in the
  background, so that the next reads find a newer one;
* else (the first read, a client polling less often than `max_stale_s`, a refresh that failed):
  the read waits for a describe, joining the one in flight if any.

While answers of a hot-load are kept, one long poll waits for its workflow to close (no load on
Temporal while it waits); when it closes, the hot-load is described at once and the index holds
it closed from then on, so its end (what a trainer waits for) shows as soon as a describe can
show it, not a refresh period later. The long poll stops when nobody has read the hot-load for
`WATCH_S`.

So an answer is never older than `max_stale_s` plus one describe, and one that starts the
refresh it waits for is exact; Temporal sees at most one describe per `revalidate_s` per polled
hot-load and view however many clients poll it, and never more than one describe per read. A
client polling every few seconds (a trainer) gets a fresh describe each time, as it did before;
clients polling many times a second (a dashboard, the Console) cost no Temporal round trip per
read, so a busy Temporal (a 1,000-replica walk) no longer sets their latency. A write through
this process (a cancel) drops the hot-load's answers (`forget`): the next read describes again.
A read never answers an older state than the index already holds (`HotLoadIndex.latest`): the
operation alone is answered from the index then, the replica entries are described again. A
closed hot-load is not kept here: the index answers it from memory from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from temporalio.client import WorkflowContinuedAsNewError, WorkflowFailureError

from api.listing import HotLoadIndex, Record

log = logging.getLogger(__name__)

REVALIDATE_S = 0.25  # a kept answer older than this is refreshed behind the reads
MAX_STALE_S = 2.0  # a kept answer older than this is not given: the read waits for a describe
MAX_KEPT = 1024  # answers kept; past this, those too old to be given are dropped
WATCH_S = 20.0  # a hot-load's close is waited for while it was read within this long

# Returns when the workflow (by id) has closed, however it ended.
Closes = Callable[[str], Awaitable[None]]


@dataclass
class _Kept:
    record: Record | None = None
    started: float = 0.0  # loop time the describe behind `record` started
    read_at: float = 0.0  # loop time of the last read
    refreshing: asyncio.Task | None = None


class OpenReads:
    def __init__(
        self, index: HotLoadIndex, *, revalidate_s: float = REVALIDATE_S, max_stale_s: float = MAX_STALE_S,
        clock: Callable[[], float] | None = None, closes: Closes | None = None, watch_s: float = WATCH_S,
    ) -> None:
        self.index = index
        self.revalidate_s, self.max_stale_s, self.watch_s = revalidate_s, max_stale_s, watch_s
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.closes = closes or self._closes
        self._kept: dict[tuple[str, bool], _Kept] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self.describes = 0  # describes started here (tests count them)

    async def read(self, workflow_id: str, *, replicas: bool) -> Record | None:
        """The operation (by workflow id) as described at most `max_stale_s` ago, see above;
        None: no such hot-load. Raises RPCError when Temporal is unreachable and nothing recent
        enough is kept."""
        now = self.clock()
        key = (workflow_id, replicas)
        kept = self._kept.get(key)
        if kept is not None:
            kept.read_at = now
        if workflow_id not in self._watches:
            self._watches[workflow_id] = asyncio.create_task(self._watch(workflow_id))
        if kept is not None and kept.record is not None and now - kept.started <= self.max_stale_s:
            if now - kept.started > self.revalidate_s:
                self._refresh(key, kept)
            latest = self.index.latest(kept.record)
            if latest is kept.record or not replicas:
                return latest
            # The index holds a newer state (a read of the other view, a listing): the entries
            # kept are older than what this process already answered; describe them again.
        if kept is None:
            kept = self._keep(key, now)
        return await asyncio.shield(self._refresh(key, kept))

    def forget(self, workflow_id: str) -> None:
        """Drops what is kept of the operation (a write changed it): the next read describes. A
        describe in flight finishes into the dropped answer, never into a new one."""
        for replicas in (False, True):
            self._kept.pop((workflow_id, replicas), None)

    async def close(self) -> None:
        tasks = [k.refreshing for k in self._kept.values() if k.refreshing is not None]
        tasks += self._watches.values()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _keep(self, key: tuple[str, bool], now: float) -> _Kept:
        if len(self._kept) >= MAX_KEPT:
            for k, v in list(self._kept.items()):
                if now - v.started > self.max_stale_s and (v.refreshing is None or v.refreshing.done()):
                    del self._kept[k]
        kept = self._kept[key] = _Kept(read_at=now)
        return kept

    def _refresh(self, key: tuple[str, bool], kept: _Kept) -> asyncio.Task:
        """The describe in flight for `key`, or a new one (single-flight)."""
        if kept.refreshing is None or kept.refreshing.done():
            self.describes += 1
            kept.refreshing = asyncio.create_task(self._describe(key, kept))
            kept.refreshing.add_done_callback(_retrieve)
        return kept.refreshing

    async def _describe(self, key: tuple[str, bool], kept: _Kept) -> Record | None:
        started = self.clock()
        rec = await self.index.read(key[0], replicas=key[1])
        if rec is None or rec.closed:
            if self._kept.get(key) is kept:
                del self._kept[key]
        elif started >= kept.started:
            kept.record, kept.started = rec, started
        return rec


    def _read_within(self, workflow_id: str, seconds: float) -> bool:
        now = self.clock()
        return any(now - k.read_at <= seconds for (wf, _), k in self._kept.items() if wf == workflow_id)

    async def _watch(self, workflow_id: str) -> None:
        """Waits for the workflow to close while its answers are read, then describes it (the
        index holds it closed) and drops what is kept."""
        try:
            while True:
                try:
                    await asyncio.wait_for(self.closes(workflow_id), timeout=self.watch_s)
                    break
                except TimeoutError:
                    if not self._read_within(workflow_id, self.watch_s):
                        return
            with contextlib.suppress(Exception):  # unreachable: the next read describes
                await self.index.read(workflow_id, replicas=False)
            self.forget(workflow_id)
        except Exception as exc:  # noqa: BLE001 - Temporal unreachable: reads refresh as above
            log.debug("waiting for %s to close failed: %s", workflow_id, exc)
        finally:
            if self._watches.get(workflow_id) is asyncio.current_task():
                del self._watches[workflow_id]

    async def _closes(self, workflow_id: str) -> None:
        """A long poll on the workflow's close event."""
        try:
            await self.index.client.get_workflow_handle(workflow_id).result(follow_runs=False)
        except (WorkflowFailureError, WorkflowContinuedAsNewError):
            pass  # failed, canceled, terminated, timed out: closed all the same


def _retrieve(task: asyncio.Task) -> None:
    """A background refresh's failure is logged; the reads that waited for it got it raised."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("refreshing an open hot-load failed: %s", exc)
