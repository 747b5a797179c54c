"""Fast, correct hot-load listings over Temporal visibility, and stable page tokens.

Listing every hot-load's memo per request costs ~250 ms with 500 operations in history (the
visibility RPC dominates; measured with bench/list_latency.py). A closed hot-load never changes
again (its id cannot be reused), so `HotLoadIndex` keeps, per listing scope (organization, and
deployment if filtered), the closed operations it has seen, and per request asks visibility only
for what may have changed: `ExecutionStatus='Running' OR CloseTime >= <newest close seen>`
(~4 ms), plus a count of closed operations in scope (~4 ms). When the count differs from the
cache (an operation became visible late, or retention deleted some), it reloads the scope in
full. A fresh process (an API restart) starts empty and loads each scope on first use, so closed
operations read correctly with or without workers.

Order is newest first by `createdAt`, id breaking ties (the SQLite visibility store cannot
ORDER BY). Page tokens are keyset cursors (the last item's sort key, bound to the listing's
filter): a hot-load created between two pages does not shift or repeat items.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError

from api.errors import InvalidArgument, Unavailable

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50
MAX_SCOPES = 256

# (hot-load dict, workflow status, close time) -> the hot-load as it really stands.
Reconcile = Callable[[dict[str, Any], WorkflowExecutionStatus | None, datetime | None], dict[str, Any]]


def sort_key(hot_load: dict[str, Any]) -> tuple[str, str]:
    return (hot_load["status"]["createdAt"], hot_load["spec"]["id"])


@dataclass
class _Scope:
    # id -> hot-load; None for a row that carries no hot-load (counted, never listed).
    closed: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    newest_close: datetime | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class HotLoadIndex:
    def __init__(self, client: Client, reconcile: Reconcile) -> None:
        self.client = client
        self.reconcile = reconcile
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self.full_loads = 0  # how often a scope was read in full (first use, or a disagreement)

    def _scope(self, query: str) -> _Scope:
        scope = self._scopes.pop(query, None) or _Scope()
        self._scopes[query] = scope  # most recently used last
        while len(self._scopes) > MAX_SCOPES:
            self._scopes.popitem(last=False)
        return scope

    async def _hot_load(self, wf: WorkflowExecution) -> dict[str, Any] | None:
        memo = await wf.memo()
        if "hotLoad" not in memo:
            return None
        return self.reconcile(memo, wf.status, wf.close_time)["hotLoad"]

    async def list(self, query: str) -> list[dict[str, Any]]:
        """Every hot-load matching `query` (a visibility query), newest first."""
        scope = self._scope(query)
        try:
            async with scope.lock:
                running = await self._refresh(scope, query)
        except RPCError as exc:
            raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        items = [h for h in scope.closed.values() if h is not None]
        items += [h for i, h in running.items() if i not in scope.closed]
        items.sort(key=sort_key, reverse=True)
        return items

    async def _refresh(self, scope: _Scope, query: str) -> dict[str, dict[str, Any]]:
        """Brings `scope.closed` up to date; returns the running hot-loads by id."""
        running: dict[str, dict[str, Any]] = {}
        if scope.newest_close is not None:
            # Closed at or after the newest close we saw (>=: equal close times are not lost).
            since = (scope.newest_close - timedelta(microseconds=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            delta = f"{query} AND (ExecutionStatus = 'Running' OR CloseTime >= '{since}')"
            async for wf in self.client.list_workflows(delta, page_size=MAX_PAGE_SIZE):
                await self._take(scope, wf, running)
            closed = await self.client.count_workflows(f"{query} AND ExecutionStatus != 'Running'")
            if closed.count == len(scope.closed):
                return running
        # First use of this scope, or the cache disagrees with visibility: load it all again.
        scope.closed, scope.newest_close, running = {}, None, {}
        self.full_loads += 1
        async for wf in self.client.list_workflows(query, page_size=MAX_PAGE_SIZE):
            await self._take(scope, wf, running)
        return running

    async def _take(self, scope: _Scope, wf: WorkflowExecution, running: dict[str, dict[str, Any]]) -> None:
        """Files one visibility row: running ones decoded every time (they change), closed ones
        once ever (they do not)."""
        if wf.status == WorkflowExecutionStatus.RUNNING or wf.close_time is None:
            hl = await self._hot_load(wf)
            if hl is not None:
                running[wf.id] = hl
            return
        if scope.newest_close is None or wf.close_time > scope.newest_close:
            scope.newest_close = wf.close_time
        if wf.id not in scope.closed:
            scope.closed[wf.id] = await self._hot_load(wf)


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


def page_size(max_page_size: int | None) -> int:
    size = DEFAULT_PAGE_SIZE if not max_page_size else max_page_size
    if size < 0:
        raise InvalidArgument("maxPageSize must not be negative")
    return min(size, MAX_PAGE_SIZE)


def page(
    items: list[Any],
    max_page_size: int | None,
    page_token: str | None,
    scope: str,
    key: Callable[[Any], Any] | None = None,
) -> tuple[list[Any], str | None]:
    """One page of `items` (already in listing order) and the token of the next, if any.

    With `key` (the listing's sort key, descending), the token is a keyset cursor: the next page
    starts after the last item returned, wherever it now is. Without, an offset.
    """
    size = page_size(max_page_size)
    start = 0
    if page_token:
        doc = _decode(page_token, scope)
        if key is not None:
            if "k" not in doc or not isinstance(doc["k"], list):
                raise InvalidArgument("pageToken is not a token this listing returned")
            after = tuple(doc["k"])
            start = next((i for i, item in enumerate(items) if tuple(key(item)) < after), len(items))
        else:
            try:
                start = int(doc["o"])
            except Exception:
                raise InvalidArgument("pageToken is not a token this listing returned") from None
            if start < 0:
                raise InvalidArgument("pageToken is not a token this listing returned")
    chunk = items[start : start + size]
    if start + size >= len(items) or not chunk:
        return chunk, None
    if key is not None:
        return chunk, _encode({"s": scope, "k": list(key(chunk[-1]))})
    return chunk, _encode({"s": scope, "o": start + size})
