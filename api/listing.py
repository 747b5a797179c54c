"""Hot-load reads answered from memory: listings newest first with stable page tokens, and
closed operations by id; plus offset pages for short lists.

Invariants: a closed hot-load is decoded once into a ``Record`` and served from memory for ever;
records are keyed by workflow id (``hotLoads/ORG/ID``); order is newest ``createdAt`` first, id
breaking ties, and page tokens are keyset cursors bound to the filter (valid across restarts,
no shift or repeat); reads and refreshes are single-flight; a request answers from memory only
when its scope was refreshed at most ``STALE_S`` ago, else it waits for a refresh (unavailable
if Temporal is). Refresh, verification and freshness: docs/design.md "Hot-load listings from
memory".
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from common.flight import SingleFlight
from contracts import names
from contracts.errors import InvalidArgument, Unavailable
from contracts.memo import replica_list
from contracts.search import DEPLOYMENT, ORG

log = logging.getLogger("rollouts.api.listing")

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50
MAX_SCOPES = 256
MAX_CLOSED_BY_ID = 10_000
REFRESH_S = 0.5  # background refresh period while listings are being read
ACTIVE_S = 30.0  # a listing unread for this long is no longer refreshed
STALE_S = 2.0  # a request waits for a refresh rather than answer from an older one
VERIFY_S = 10.0  # how often a listing being read is checked against a count
RUNNING = "ResourceKind='hotLoad' AND ExecutionStatus = 'Running'"
RECENT_S = 120.0  # own creates are listed this long even if visibility does not show them yet
DECODE_BATCH = 50  # memos decoded between yields to the event loop (a full load is long)

# (memo, workflow status, close time) -> the memo as the operation really stands.
Reconcile = Callable[[dict[str, Any], WorkflowExecutionStatus | None, datetime | None], dict[str, Any]]


def quote(value: str) -> str:
    """A string literal for a visibility query."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def dumps(doc: Any) -> bytes:
    """JSON as FastAPI's JSONResponse writes it."""
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def is_closed(status: WorkflowExecutionStatus | None, close_time: datetime | None) -> bool:
    return status != WorkflowExecutionStatus.RUNNING and close_time is not None


async def _hot_load_memo(wf: WorkflowExecution, *, whole: bool) -> Mapping[str, Any] | None:
    """The execution's memo: ``whole``, or only its ``hotLoad`` entry (a running operation's
    replica entries left undecoded). None: it carries no hot-load."""
    if whole:
        memo = await wf.memo()
    else:
        try:
            memo = {"hotLoad": await wf.memo_value("hotLoad")}
        except KeyError:
            return None
    return memo if "hotLoad" in memo else None


@dataclass(frozen=True)
class Record:
    """One hot-load as last read; never mutated (a newer read makes a new record)."""

    id: str  # the workflow id (`hotLoads/ORG/ID`, contracts/names.py): unique across organizations
    key: tuple[str, str]  # (createdAt, workflow id): the listing's sort key
    organization_id: str
    deployment_id: str
    closed: bool
    updated_at: str
    hot_load: dict[str, Any]
    replicas: list[dict[str, Any]]
    json: bytes  # `hot_load` encoded

    def newer_than(self, other: Record) -> bool:
        if other.closed:
            return False  # a closed operation's record is final
        return self.closed or self.updated_at >= other.updated_at


@dataclass
class _Scope:
    organization_id: str
    deployment_id: str | None
    closed_ids: set[str] = field(default_factory=set)  # closed per visibility (counted)
    open_ids: set[str] = field(default_factory=set)  # running per visibility's last answer
    loaded_at: float | None = None  # loop times: the last full read started
    fresh_at: float = 0.0  # the last full read or refresh that reached this scope started
    verified_at: float = 0.0  # the last count
    last_read: float = 0.0
    order: list[tuple[str, str]] | None = None  # members' sort keys, ascending; None: rebuild
    built_at_version: int = -1
    loading: SingleFlight = field(default_factory=SingleFlight)

    @property
    def query(self) -> str:
        q = f"ResourceKind='hotLoad' AND OrganizationId={quote(self.organization_id)}"
        if self.deployment_id:
            q += f" AND DeploymentId={quote(self.deployment_id)}"
        return q

    @property
    def token_scope(self) -> str:
        return f"hotLoads:{self.deployment_id or ''}"

    def covers(self, organization_id: str, deployment_id: str) -> bool:
        return organization_id == self.organization_id and (
            not self.deployment_id or deployment_id == self.deployment_id
        )

    def holds(self, rec: Record) -> bool:
        return self.covers(rec.organization_id, rec.deployment_id)


class HotLoadIndex:
    def __init__(
        self, client: Client, reconcile: Reconcile, view: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    ) -> None:
        self.client = client
        self.reconcile = reconcile
        self.view = view or (lambda hot_load: hot_load)
        # Timings (module constants; tests stretch them to take the clock out).
        self.refresh_s, self.stale_s, self.verify_s, self.active_s = REFRESH_S, STALE_S, VERIFY_S, ACTIVE_S
        self.records: dict[str, Record] = {}  # every id some scope lists, and own recent creates
        self._closed_by_id: OrderedDict[str, Record] = OrderedDict()  # read by id, LRU
        self._recent: dict[str, float] = {}  # own creates: id -> loop time created
        self._version = 0  # bumped when `_recent` changes: scopes rebuild their order
        self._scopes: OrderedDict[tuple[str, str | None], _Scope] = OrderedDict()
        self._refreshing = SingleFlight()
        self._poller: asyncio.Task | None = None
        self.full_loads = 0  # how often a scope was read in full (first use, or a disagreement)
        self.refreshes = 0  # refreshes of the loaded scopes (one visibility call each)

    # ------------------------------------------------------------------ records
    def record(self, memo: dict[str, Any], closed: bool) -> Record:
        hot_load = self.view(memo["hotLoad"])
        spec, status = hot_load["spec"], hot_load["status"]
        replicas = sorted(replica_list(memo), key=lambda r: (r.get("zone", ""), r.get("name", "")))
        workflow_id = names.hot_load_workflow_id(spec.get("organizationId", ""), spec["id"])
        return Record(
            id=workflow_id,
            key=(status["createdAt"], workflow_id),
            organization_id=spec.get("organizationId", ""),
            deployment_id=spec.get("deploymentId", ""),
            closed=closed,
            updated_at=status.get("updatedAt") or "",
            hot_load=hot_load,
            replicas=replicas,
            json=dumps(hot_load),
        )

    def _known(self, workflow_id: str) -> Record | None:
        return self.records.get(workflow_id) or self._closed_by_id.get(workflow_id)

    def _store(self, rec: Record, *, listed: bool) -> Record:
        """Keeps the newer of `rec` and what is held; `listed` records are kept while listed."""
        cur = self._known(rec.id)
        if cur is not None and not rec.newer_than(cur):
            rec = cur
        if listed or rec.id in self.records:
            self.records[rec.id] = rec
        if rec.closed:
            self._closed_by_id[rec.id] = rec
            self._closed_by_id.move_to_end(rec.id)
            while len(self._closed_by_id) > MAX_CLOSED_BY_ID:
                self._closed_by_id.popitem(last=False)
        return rec

    def closed(self, workflow_id: str) -> Record | None:
        """The operation (by workflow id) if it is known to have closed (then it never changes):
        no Temporal call."""
        rec = self._known(workflow_id)
        return rec if rec is not None and rec.closed else None

    def latest(self, rec: Record) -> Record:
        """`rec`, or what the index holds of the same operation if that is newer."""
        cur = self._known(rec.id)
        if cur is not None and not rec.closed and (cur.closed or cur.updated_at > rec.updated_at):
            return cur
        return rec

    def observed(self, memo: dict[str, Any], closed: bool) -> Record:
        """A fresh read of one operation (a describe): listings show it from now on."""
        return self._store(self.record(memo, closed), listed=False)

    def created(self, hot_load: dict[str, Any]) -> Record:
        """An operation this process just created: listed at once, before visibility has it."""
        rec = self._store(self.record({"hotLoad": hot_load}, closed=False), listed=True)
        self._recent[rec.id] = asyncio.get_running_loop().time()
        self._version += 1
        return rec

    # ------------------------------------------------------------------ listing
    async def page(
        self, organization_id: str, deployment_id: str | None, max_page_size: int | None, page_token: str | None
    ) -> tuple[list[bytes], str | None]:
        """One page of the listing (each hot-load as JSON), newest first, and the next token."""
        scope = self._scope(organization_id, deployment_id)
        size = page_size(max_page_size)
        after = _keyset_token(page_token, scope.token_scope) if page_token else None
        now = asyncio.get_running_loop().time()
        scope.last_read = now
        try:
            if scope.loaded_at is None:
                await scope.loading.join(lambda: self._load(scope))
            elif now - scope.fresh_at > self.stale_s:
                await self._refresh()
        except RPCError as exc:
            raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._keep_fresh())
        order = self._order(scope)
        end = len(order) if after is None else bisect.bisect_left(order, after)
        start = max(0, end - size)
        keys = order[start:end][::-1]
        token = _encode({"s": scope.token_scope, "k": list(keys[-1])}) if start > 0 and keys else None
        return [rec.json for _, i in keys if (rec := self.records.get(i)) is not None], token

    def _scope(self, organization_id: str, deployment_id: str | None) -> _Scope:
        name = (organization_id, deployment_id or None)
        scope = self._scopes.pop(name, None) or _Scope(organization_id, deployment_id or None)
        self._scopes[name] = scope  # most recently used last
        while len(self._scopes) > MAX_SCOPES:
            self._scopes.popitem(last=False)
            self._collect()
        return scope

    def _order(self, scope: _Scope) -> list[tuple[str, str]]:
        now = asyncio.get_running_loop().time()
        expired = [i for i, t in self._recent.items() if now - t > RECENT_S]
        for workflow_id in expired:
            del self._recent[workflow_id]
        if expired:
            self._version += 1
        if scope.order is None or scope.built_at_version != self._version:
            members = scope.closed_ids | scope.open_ids
            members.update(i for i in self._recent if scope.holds(self.records[i]))
            scope.order = sorted(self.records[i].key for i in members if i in self.records)
            scope.built_at_version = self._version
        return scope.order

    # ------------------------------------------------------------------ visibility
    async def _load(self, scope: _Scope) -> None:
        """Reads a scope in full: on first use, and when a count disagrees with it."""
        started = asyncio.get_running_loop().time()
        self.full_loads += 1
        closed_ids: set[str] = set()
        open_ids: set[str] = set()
        decoded = 0
        async for wf in self.client.list_workflows(scope.query, page_size=MAX_PAGE_SIZE):
            closed = is_closed(wf.status, wf.close_time)
            if closed:
                closed_ids.add(wf.id)  # counted even if it is no hot-load (never listed)
            if await self._file(wf, closed) is not None and not closed:
                open_ids.add(wf.id)
            decoded += 1
            if decoded % DECODE_BATCH == 0:
                await asyncio.sleep(0)  # let other requests through during a long load
        scope.closed_ids, scope.open_ids, scope.order = closed_ids, open_ids, None
        scope.loaded_at = scope.fresh_at = scope.verified_at = started
        self._collect()

    async def _refresh(self) -> None:
        """Brings every loaded scope up to date at once (single flight)."""
        await self._refreshing.join(self._refresh_now)

    async def _refresh_now(self) -> None:
        """One visibility call for the running hot-loads (indexed by status: its cost follows
        what runs, not the history), then a describe of each one that left that set since the
        last look (it closed) or that visibility does not show yet (an own create); one already
        known closed (read by id) needs no call."""
        started = asyncio.get_running_loop().time()
        scopes = [s for s in self._scopes.values() if s.loaded_at is not None]
        if not scopes:
            return
        self.refreshes += 1
        watched = {i for s in scopes for i in s.open_ids} | self._recent.keys()
        running: dict[str, Record] = {}
        async for wf in self.client.list_workflows(RUNNING, page_size=MAX_PAGE_SIZE):
            attrs = wf.typed_search_attributes
            if any(s.covers(attrs.get(ORG) or "", attrs.get(DEPLOYMENT) or "") for s in scopes):
                rec = await self._file(wf, closed=False)  # no scope lists the others: not decoded
                if rec is not None:
                    running[wf.id] = rec
        ended: dict[str, Record] = {}
        for workflow_id in watched - running.keys():
            rec = self.closed(workflow_id) or await self.read(workflow_id)
            if rec is not None:
                (ended if rec.closed else running)[workflow_id] = rec
        for s in scopes:
            if s.loaded_at is None or s.loaded_at > started:
                continue  # (re)loaded while this ran: that is fresher
            open_ids = {i for i, rec in running.items() if s.holds(rec)}
            closed_ids = s.closed_ids | {i for i, rec in ended.items() if s.holds(rec)}
            if open_ids != s.open_ids or closed_ids != s.closed_ids:
                s.open_ids, s.closed_ids, s.order = open_ids, closed_ids, None
            s.fresh_at = started

    async def read(self, workflow_id: str, *, replicas: bool = True) -> Record | None:
        """Describes one operation (by workflow id) now (its memo, reconciled) and keeps what it
        says; None: no such hot-load. Raises RPCError when Temporal is unreachable. Without
        `replicas`, a running operation's replica entries are not decoded (a large deployment's
        are hundreds of KB) and the record carries none."""
        try:
            desc = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        closed = is_closed(desc.status, desc.close_time)
        memo = await _hot_load_memo(desc, whole=replicas or closed)
        if memo is None:
            return None
        return self.observed(self.reconcile(memo, desc.status, desc.close_time), closed)  # type: ignore[arg-type]  # memo(): a dict, typed Mapping

    async def _verify(self, scope: _Scope) -> None:
        """Counts the scope's closed operations: one the refreshes never saw running (created
        elsewhere and ended within a refresh period), a late-visible one, or history deleted by
        retention makes the count disagree, and the scope is read again."""
        counted = await self.client.count_workflows(f"{scope.query} AND ExecutionStatus != 'Running'")
        scope.verified_at = asyncio.get_running_loop().time()
        if counted.count != len(scope.closed_ids):
            await scope.loading.join(lambda: self._load(scope))

    async def _keep_fresh(self) -> None:
        """Refreshes while some listing is being read; stops `active_s` after the last read."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.refresh_s)
            active = [
                s
                for s in self._scopes.values()
                if s.loaded_at is not None and loop.time() - s.last_read < self.active_s
            ]
            if not active:
                return
            try:
                await self._refresh()
                for s in active:
                    if loop.time() - s.verified_at >= self.verify_s:
                        await self._verify(s)
            except RPCError as exc:  # requests notice (stale_s) and answer unavailable
                log.debug("refreshing hot-load listings failed: %s", exc)

    async def _file(self, wf: WorkflowExecution, closed: bool) -> Record | None:
        """One visibility row as a record: a closed one decoded once ever, an open one each time
        (it changes). None: the row carries no hot-load."""
        held = self.closed(wf.id)
        if held is not None:
            self.records[wf.id] = held
            return held
        # Listings show no replica entries: a running one's are not decoded.
        memo = await _hot_load_memo(wf, whole=closed)
        if memo is None:
            return None
        return self._store(
            self.record(self.reconcile(memo, wf.status, wf.close_time), closed),  # type: ignore[arg-type]  # memo(): a dict, typed Mapping
            listed=True,
        )

    def _collect(self) -> None:
        """Drops records no scope lists any more (a scope evicted or reloaded)."""
        live = set(self._recent)
        for scope in self._scopes.values():
            live |= scope.closed_ids
            live |= scope.open_ids
        for workflow_id in [i for i in self.records if i not in live]:
            del self.records[workflow_id]

    async def close(self) -> None:
        tasks: list[asyncio.Future[Any]] = [self._poller] if self._poller is not None else []
        if self._poller is not None:
            self._poller.cancel()
        tasks += self._refreshing.cancel()
        for s in self._scopes.values():
            tasks += s.loading.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------- pagination
def _encode(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode(token: str, scope: str) -> dict[str, Any]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode() + b"=="))
        token_scope = doc["s"]
    except Exception:
        raise InvalidArgument("pageToken is not a token this listing returned") from None
    if token_scope != scope:
        raise InvalidArgument("pageToken belongs to a different listing (keep the same filter)")
    return doc


def _keyset_token(token: str, scope: str) -> tuple[str, str]:
    key = _decode(token, scope).get("k")
    if not (isinstance(key, list) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise InvalidArgument("pageToken is not a token this listing returned")
    return (key[0], key[1])


def page_size(max_page_size: int | None) -> int:
    size = DEFAULT_PAGE_SIZE if not max_page_size else max_page_size
    if size < 0:
        raise InvalidArgument("maxPageSize must not be negative")
    return min(size, MAX_PAGE_SIZE)


def page(
    items: list[Any], max_page_size: int | None, page_token: str | None, scope: str
) -> tuple[list[Any], str | None]:
    """One page of a short list (already in order) and the token of the next, if any: an offset."""
    size = page_size(max_page_size)
    start = 0
    if page_token:
        doc = _decode(page_token, scope)
        try:
            start = int(doc["o"])
        except Exception:
            raise InvalidArgument("pageToken is not a token this listing returned") from None
        if start < 0:
            raise InvalidArgument("pageToken is not a token this listing returned")
    chunk = items[start : start + size]
    if start + size >= len(items) or not chunk:
        return chunk, None
    return chunk, _encode({"s": scope, "o": start + size})
