"""The processes this test session started, found in /proc: vLLM engines and SeaweedFS servers.

tests/conftest.py puts a marker (``ROLLOUTS_TEST_SESSION=<id>``) in the session's environment
before any test runs; every process a test starts inherits it (the stack, the control worker, the
replicas and their engines copy ``os.environ``). An engine is a process running
``replica.launch.SERVER_MODULE`` or ``DYNAMO_WORKER_MODULE`` whose parent is not one too (vLLM's own worker processes
are children of it, and count with it as one engine).

``EngineWatch`` samples them in a background thread: it remembers the first moment more than
``MAX_ENGINES`` engines were alive at once (within a test as well as between two), and which test
was running when each engine or SeaweedFS server first appeared.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from replica.launch import DYNAMO_WORKER_MODULE, SERVER_MODULE

SESSION_ENV = "ROLLOUTS_TEST_SESSION"
# vLLM CPU engines take ~2-3 GiB each and the machine has 2 cores: a full run keeps at most three.
MAX_ENGINES = 3
ENGINE_MARK = SERVER_MODULE.encode()  # `python -m replica.engine.server ...`
DYNAMO_MARK = DYNAMO_WORKER_MODULE.encode()  # `python -m replica.engine.dynamo_worker ...` (also an engine)
STACK_MARK = b"weed"  # SeaweedFS: only the embedded stack starts it
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def uptime() -> float:
    """Seconds since boot, the clock of a process's start time in /proc."""
    return float(Path("/proc/uptime").read_text().split()[0])


def mark_session(worker: str = "") -> str:
    """Put this session's marker in the environment (idempotent); returns it. An xdist worker
    (``worker``: gw0, gw1, ...) is a session of its own: it inherits the controller's marker and
    adds its name, so each worker watches only the engines that its own tests started."""
    mark = os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)
    if worker and not mark.endswith(f"-{worker}"):
        mark = os.environ[SESSION_ENV] = f"{mark}-{worker}"
    return mark


@dataclass(frozen=True)
class Proc:
    pid: int
    cmdline: str
    started: float = 0.0  # seconds since boot


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:  # gone, or not ours
        return None


def session_processes(*marks: bytes, session: str | None = None) -> dict[bytes, list[Proc]]:
    """For each mark, the processes of this session whose command line contains it, without those
    whose parent matches it too. One pass over /proc."""
    tag = f"{SESSION_ENV}={session or os.environ.get(SESSION_ENV, '')}".encode()
    found: dict[bytes, dict[int, tuple[int, bytes, float]]] = {mark: {} for mark in marks}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        cmdline = _read(f"/proc/{entry.name}/cmdline")
        hits = [mark for mark in marks if cmdline and mark in cmdline]
        if not hits:
            continue
        environ = _read(f"/proc/{entry.name}/environ")
        stat = _read(f"/proc/{entry.name}/stat")
        if not environ or not stat or tag not in environ.split(b"\0"):
            continue
        fields = stat.rsplit(b")", 1)[1].split()  # from field 3 (state) on; see proc(5)
        ppid, started = int(fields[1]), int(fields[19]) / CLOCK_TICKS
        for mark in hits:
            found[mark][int(entry.name)] = (ppid, cmdline, started)
    return {
        mark: [
            Proc(pid, cmd.replace(b"\0", b" ").decode(errors="replace").strip(), started)
            for pid, (ppid, cmd, started) in sorted(procs.items())
            if ppid not in procs
        ]
        for mark, procs in found.items()
    }


def engines(session: str | None = None) -> list[Proc]:
    procs = session_processes(ENGINE_MARK, DYNAMO_MARK, session=session)
    return procs[ENGINE_MARK] + procs[DYNAMO_MARK]


def wait_engines_at_most(n: int, timeout: float = 300) -> None:
    """Wait until at most ``n`` engines of this session are alive (a deleted deployment's replicas
    stop a few seconds after its workflow ends)."""
    deadline = time.monotonic() + timeout
    while len(alive := engines()) > n:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(alive)} vLLM engines still alive after {timeout:.0f}s, want <= {n}: "
                + "; ".join(f"pid {p.pid}" for p in alive)
            )
        time.sleep(0.5)


@dataclass
class EngineWatch:
    """Samples this session's engines and SeaweedFS servers every ``interval`` seconds in a
    daemon thread. It remembers the first moment more than ``limit`` engines were alive, and for
    each test (``enter``, called by tests/conftest.py) the processes first seen while it ran."""

    interval: float = 1.0
    limit: int = MAX_ENGINES
    session: str | None = None  # None: this session's marker
    node: str = ""  # the test running (its node id) and the phase
    phase: str = "collection"
    peak: int = 0
    started: int = 0  # engines seen (each once): where most of the suite's CPU goes
    samples: int = 0
    sample_seconds: float = 0.0  # CPU time spent sampling
    excess: str | None = None
    started_by: dict[str, list[Proc]] = field(default_factory=dict)  # test -> processes new while it ran
    since: dict[str, float] = field(default_factory=dict)  # test -> uptime() when it began
    _seen: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        t0 = time.thread_time()  # CPU, not wall: the thread waits on the GIL behind the tests
        procs = session_processes(ENGINE_MARK, DYNAMO_MARK, STACK_MARK, session=self.session)
        with self._lock:
            self.sample_seconds += time.thread_time() - t0
            self.samples += 1
            alive = procs[ENGINE_MARK] + procs[DYNAMO_MARK]
            self.peak = max(self.peak, len(alive))
            if len(alive) > self.limit and self.excess is None:
                self.excess = (
                    f"{len(alive)} vLLM engines of this test session alive at once during {self.node} ({self.phase}) "
                    f"(at most {self.limit}): " + "; ".join(f"pid {p.pid}: {p.cmdline[:160]}" for p in alive)
                )
            for proc in alive + procs[STACK_MARK]:
                if proc.pid not in self._seen:
                    self._seen.add(proc.pid)
                    self.started += proc in alive
                    self.started_by.setdefault(self.node, []).append(proc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def enter(self, nodeid: str, phase: str) -> None:
        with self._lock:
            self.node, self.phase = nodeid, phase
            self.since.setdefault(nodeid, uptime())

    def take_excess(self) -> str | None:
        with self._lock:
            excess, self.excess = self.excess, None
        return excess

    def started_during(self, nodeid: str) -> list[Proc]:
        """Processes first seen while ``nodeid`` ran that also started after it began (one a
        previous test started just before it ended is not this test's)."""
        with self._lock:
            since = self.since.get(nodeid, 0.0)
            return [proc for proc in self.started_by.get(nodeid, []) if proc.started >= since]
