"""Background jobs of the engine's worker: the expensive parts of an update run off the RPC.

An RPC runs inside the engine core's loop, so a long one stalls generation as surely as a pause.
Staging, transfers and checksums therefore run on a thread of the worker (:class:`Job`), one at
a time, while the engine keeps serving. A job's final status ``{"kind", "state": "done" |
"failed", "result", "error"}`` is also written as JSON (atomically) to its result file
(:func:`result_path`), so a caller on the same host waits on that file instead of polling over
RPC: every RPC makes vLLM's worker busy-poll its message queue afterwards (``shm_broadcast``'s
spin, capped by `replica.engine.plugin`), and polling kept every worker of a host spinning.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from common import envs

logger = logging.getLogger("rollouts.engine.jobs")

_SEQ = iter(range(1, 1 << 62))


def result_path(kind: str) -> str:
    """A fresh result file for a ``kind`` job (``ROLLOUTS_JOB_DIR``, else a per-process temp dir)."""
    directory = envs.ROLLOUTS_JOB_DIR.get() or os.path.join(tempfile.gettempdir(), f"rollouts-jobs-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{next(_SEQ)}-{kind}.json")


class Job:
    """One background job: runs ``fn`` (which returns a JSON-able dict) on a daemon thread."""

    def __init__(self, kind: str, fn: Callable[[], dict[str, Any]], path: str | None = None) -> None:
        self.kind = kind
        self.state = "running"
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.result_path = path
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"rollouts-{kind}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            result = fn()
            result["seconds"] = round(time.perf_counter() - self.started, 6)
            self.result, self.state = result, "done"
        except BaseException as exc:  # noqa: BLE001 - reported through status()
            logger.exception("background %s failed", self.kind)
            self.error, self.state = f"{type(exc).__name__}: {exc}", "failed"
        if self.result_path:
            try:
                tmp = f"{self.result_path}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.status(), f)
                os.replace(tmp, self.result_path)
            except Exception:  # noqa: BLE001 - status() still answers
                logger.exception("could not write %s", self.result_path)

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": self.state, "result": self.result, "error": self.error}


IDLE = {"kind": None, "state": "idle", "result": None, "error": None}


class JobRunner:
    """The worker's job slots: one for the jobs that read or stage weights, and one beside it for
    a job that moves only the agent's files (a delta's files sent to peers), so that a sender
    passes an update on while it stages the same update itself. Starting a job in a busy slot
    is refused."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self.beside: Job | None = None

    def start(self, kind: str, fn: Callable[[], dict[str, Any]], beside: bool = False) -> dict[str, Any]:
        current = self.beside if beside else self.job
        if current is not None and current.state == "running":
            raise RuntimeError(f"a background {current.kind} job is still running")
        path = result_path(kind)
        job = Job(kind, fn, path)
        if beside:
            self.beside = job
        else:
            self.job = job
        return {"kind": kind, "state": "running", "result_path": path}

    def status(self, kind: str | None = None) -> dict[str, Any]:
        """The main slot's job, or the latest job of ``kind`` in either slot."""
        for job in (self.job, self.beside) if kind is not None else (self.job,):
            if job is not None and job.kind == kind:
                return job.status()
        return dict(IDLE) if self.job is None or kind is not None else self.job.status()
