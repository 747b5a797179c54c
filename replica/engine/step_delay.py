"""A slowed engine, for tests and benchmarks that need requests to stay in flight: with a delay
set, every engine step (vLLM's ``Worker.execute_model``, in the engine's worker process) first
sleeps that long; ``0`` restores the worker's own method.

Why: a test that must pause an engine while requests run cannot rely on the requests outlasting
the pause call's way to the engine. On a loaded 2-core machine every process here stalls now and
then for seconds (docs/field-notes.md), longer than a request of a thousand tokens takes; with
steps slowed, the requests outlast any such stall, and the test asserts that they did.
``set_step_delay(worker, seconds)`` answers ``{"step_delay_s"}``; a negative or non-finite delay
raises ValueError, naming it.
"""

from __future__ import annotations

import math
import time
from typing import Any

ATTRIBUTE = "execute_model"


def set_step_delay(worker: Any, seconds: float) -> dict[str, Any]:
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"step delay: {seconds!r} is not a number of seconds >= 0")
    if ATTRIBUTE in vars(worker):  # our wrapper: back to the class's own method
        delattr(worker, ATTRIBUTE)
    if seconds > 0:
        own = getattr(worker, ATTRIBUTE)

        def slowed(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return own(*args, **kwargs)

        setattr(worker, ATTRIBUTE, slowed)
    return {"step_delay_s": seconds}
