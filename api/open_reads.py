"""Reads of an open hot-load by id: a describe, waited for only as long as a read can afford.

Per open hot-load and view (the operation alone, or with its replicas), a read starts a describe
or joins the one in flight; with nothing usable kept (first read, older than `max_stale_s`,
dropped by `forget` after a cancel) it waits for it, else at most `wait_s`, answering the last
describe's answer when it is late (the late one is kept for the next reads). Invariants:
Temporal sees at most one describe per read and never two at once per hot-load and view; an
answer is at most one describe old and never older than `max_stale_s`; a read never answers an
older state than the index holds (`HotLoadIndex.latest`) or than this process already answered
in either view; a closed hot-load is not kept here (the index answers it).
docs/design.md, "Processes and who runs what".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from api.listing import HotLoadIndex, Record
from api.metrics import OPEN_READS
from common.flight import SingleFlight

log = logging.getLogger(__name__)

WAIT_S = 0.015  # how long a read with a usable kept answer waits for the describe in flight
MAX_STALE_S = 2.0  # a kept answer older than this is not given: the read waits for a describe
MAX_KEPT = 1024  # answers kept; past this, those too old to be given are dropped


@dataclass
class _Kept:
    record: Record | None = None
    started: float = 0.0  # loop time the describe behind `record` started
    refreshing: SingleFlight = field(default_factory=SingleFlight)


class OpenReads:
    def __init__(
        self,
        index: HotLoadIndex,
        *,
        wait_s: float = WAIT_S,
        max_stale_s: float = MAX_STALE_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.index = index
        self.wait_s, self.max_stale_s = wait_s, max_stale_s
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self._kept: dict[tuple[str, bool], _Kept] = {}
        self._newest: dict[str, Record] = {}  # the newest state answered per open operation, either view
        self.describes = 0  # describes started here (tests count them)
        self.kept_answers = 0  # reads answered from what was kept (the describe was late)

    async def read(self, workflow_id: str, *, replicas: bool) -> Record | None:
        """The operation (by workflow id), see above; None: no such hot-load. Raises RPCError
        when Temporal is unreachable and nothing recent enough is kept."""
        now = self.clock()
        key = (workflow_id, replicas)
        kept = self._kept.get(key) or self._keep(key, now)
        task = self._refresh(key, kept)
        fallback = self._usable(kept, now, replicas)
        if fallback is None:
            rec = await asyncio.shield(task)
            OPEN_READS.labels(answer="described").inc()
            return self._answered(rec)
        done, _ = await asyncio.wait({task}, timeout=self.wait_s)
        if done and task.exception() is None:
            OPEN_READS.labels(answer="described").inc()
            return self._answered(task.result())
        self.kept_answers += 1
        OPEN_READS.labels(answer="kept").inc()
        return self._answered(fallback)

    def forget(self, workflow_id: str) -> None:
        """Drops what is kept of the operation (a write changed it): the next read waits for a
        describe of its own. A describe in flight finishes into the dropped answer."""
        for replicas in (False, True):
            self._kept.pop((workflow_id, replicas), None)
        self._newest.pop(workflow_id, None)

    async def close(self) -> None:
        tasks = [t for k in self._kept.values() for t in k.refreshing.cancel()]
        await asyncio.gather(*tasks, return_exceptions=True)

    def _usable(self, kept: _Kept, now: float, replicas: bool) -> Record | None:
        """The answer a late describe may be replaced by, if any."""
        if kept.record is None or now - kept.started > self.max_stale_s:
            return None
        latest = self.index.latest(kept.record)
        newest = self._newest.get(kept.record.id)
        if newest is not None and newest.updated_at > latest.updated_at:
            latest = newest
        if latest is not kept.record and replicas:
            return None  # entries older than a state this process already answered
        return latest

    def _answered(self, rec: Record | None) -> Record | None:
        """Notes ``rec`` as answered: no later read of the operation answers an older state."""
        if rec is None or rec.closed:
            if rec is not None:
                self._newest.pop(rec.id, None)
            return rec
        cur = self._newest.get(rec.id)
        if cur is None or rec.updated_at > cur.updated_at:
            if cur is None and len(self._newest) >= MAX_KEPT:
                kept = {workflow_id for workflow_id, _ in self._kept}
                self._newest = {k: v for k, v in self._newest.items() if k in kept}
            self._newest[rec.id] = rec
        return rec

    def _keep(self, key: tuple[str, bool], now: float) -> _Kept:
        if len(self._kept) >= MAX_KEPT:
            for k, v in list(self._kept.items()):
                if now - v.started > self.max_stale_s and not v.refreshing.running():
                    del self._kept[k]
        kept = self._kept[key] = _Kept()
        return kept

    def _refresh(self, key: tuple[str, bool], kept: _Kept) -> asyncio.Future[Record | None]:
        """The describe in flight for `key`, or a new one (single-flight)."""

        def start() -> Awaitable[Record | None]:
            self.describes += 1
            return self._describe(key, kept)

        return kept.refreshing.call(start)

    async def _describe(self, key: tuple[str, bool], kept: _Kept) -> Record | None:
        """One describe; its failure is logged here and raised to the reads that waited for it."""
        started = self.clock()
        try:
            rec = await self.index.read(key[0], replicas=key[1])
        except Exception as exc:
            log.debug("describing an open hot-load failed: %s", exc)
            raise
        if rec is None or rec.closed:
            if self._kept.get(key) is kept:
                del self._kept[key]
        elif started >= kept.started:
            kept.record, kept.started = rec, started
        return rec
