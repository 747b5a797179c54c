"""Single flight: at most one call of an async function in progress; callers that arrive meanwhile
share it instead of starting their own.

`SingleFlight()` joins the call in progress, else starts one; `SingleFlight(after_call=True)`
gives each caller a call that started after it arrived (it joins the one queued behind the
current call, at most one). Invariants: `join` shields the call, so a caller that gives up does
not cancel it for the others; a call every caller gave up still ends and its exception is
retrieved; `cancel` stops what is in progress (on close).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class SingleFlight:
    def __init__(self, *, after_call: bool = False) -> None:
        self.after_call = after_call
        self.current: asyncio.Future[Any] | None = None
        self.queued: asyncio.Future[Any] | None = None

    def running(self) -> bool:
        return self.current is not None and not self.current.done()

    def call(self, start: Callable[[], Awaitable[Any]]) -> asyncio.Future[Any]:
        """The call this caller shares (module docstring); `start()` runs only for a new one."""
        if self.queued is not None:
            return self.queued
        if not self.running():
            self.current = _retrieved(asyncio.ensure_future(start()))
            return self.current
        previous = self.current
        assert previous is not None  # running()
        if not self.after_call:
            return previous

        async def after_previous() -> Any:
            await asyncio.wait([previous])
            self.current, self.queued = self.queued, None  # from here on, late callers queue anew
            return await start()

        self.queued = _retrieved(asyncio.ensure_future(after_previous()))
        return self.queued

    async def join(self, start: Callable[[], Awaitable[Any]]) -> Any:
        """The result of the shared call (shielded: giving up does not cancel it for the others)."""
        return await asyncio.shield(self.call(start))

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Cancels what is in progress or queued; returns it, to be awaited."""
        pending = [f for f in (self.current, self.queued) if f is not None and not f.done()]
        for f in pending:
            f.cancel()
        return pending


def _retrieved(future: asyncio.Future[Any]) -> asyncio.Future[Any]:
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
