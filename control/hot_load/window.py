"""At most k replica steps in flight, started in walk order (`hotLoad.maxConcurrentSwaps`).

`room()` waits until fewer than k steps run and raises the first step failure seen; `start`
starts the next one; `drain()` waits for them all and raises the first failure; `stop(cancel=)`
ends the window after the walk stopped: the steps in flight are canceled (a cancel) or left to
finish (a failure), and awaited either way, so the walk reports only once each of their replicas
serves either the old weights or the new ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from temporalio import workflow


class Window:
    def __init__(self, k: int) -> None:
        self.k = max(1, k)
        self.running: list[asyncio.Task[None]] = []

    def start(self, step: Coroutine[Any, Any, None]) -> None:
        self.running.append(asyncio.ensure_future(step))

    async def room(self) -> None:
        self._collect()
        while len(self.running) >= self.k:
            await workflow.wait(self.running, return_when=asyncio.FIRST_COMPLETED)
            self._collect()

    async def drain(self) -> None:
        while self.running:
            await workflow.wait(self.running, return_when=asyncio.FIRST_COMPLETED)
            self._collect()

    async def stop(self, *, cancel: bool) -> None:
        running, self.running = self.running, []
        for task in running:
            if cancel and not task.done():
                task.cancel()
        for task in running:
            try:
                await asyncio.shield(task)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the walk already stopped
                pass

    def _collect(self) -> None:
        """Drops finished steps; raises the first one's failure."""
        done = [t for t in self.running if t.done()]
        self.running = [t for t in self.running if not t.done()]
        for task in done:
            if task.cancelled():
                raise asyncio.CancelledError()
            exc = task.exception()
            if exc is not None:
                raise exc
