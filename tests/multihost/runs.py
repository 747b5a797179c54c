"""A harness run's identity and the sweep of dead runs' leftovers.

A run (one ``Cluster``) has a tag ``<owner pid in hex>s<sequence in that process>``; every name it
creates is ``rmh<tag><role>``: the bridge ``rmh<tag>br``, host K's root-end veth ``rmh<tag>vK`` and
network namespace ``rmh<tag>hK`` (interface names at most 15 characters, checked). Before it creates
anything a run writes a marker, ``/run/rollouts-multihost/<tag>.json``, holding its owner's pid and
that process's start time, and removes it when torn down.

``sweep_dead_runs()`` removes every namespace and link named like this whose run's owner is dead: the
pid no longer exists, or (with a marker) it now belongs to a process started at another time, or it
is this process and the run is not one of its live ones. It kills the processes in such a namespace
first, then deletes the veths, the namespaces, the bridge and the marker. Names of another format,
or of a run whose owner lives, are never touched. Callers hold ``state_lock()`` around the sweep and
the creation of a run, so a sweep never sees a run half-made by a live process.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.multihost.iproute import ip, kill_netns_processes, link_names, netns_names

PREFIX = "rmh"
STATE_DIR = Path("/run/rollouts-multihost")
IFNAME_MAX = 15  # IFNAMSIZ - 1
MAX_SEQ = 99
MAX_HOSTS = 99
NAME = re.compile(rf"^{PREFIX}(?P<pid>[0-9a-f]{{1,7}})s(?P<seq>\d{{1,2}})(?P<role>br|v\d{{1,2}}|h\d{{1,2}})$")

_sequence = itertools.count()
_live: set[str] = set()  # tags of this process's runs not yet torn down


@dataclass(frozen=True)
class RunTag:
    pid: int
    seq: int

    @property
    def text(self) -> str:
        return f"{self.pid:x}s{self.seq}"

    def _name(self, role: str) -> str:
        name = f"{PREFIX}{self.text}{role}"
        if len(name) > IFNAME_MAX or not NAME.match(name):
            raise ValueError(f"harness name {name!r} is not a valid name of {IFNAME_MAX} characters or fewer")
        return name

    @property
    def bridge(self) -> str:
        return self._name("br")

    def veth(self, index: int) -> str:
        return self._name(f"v{index}")

    def netns(self, index: int) -> str:
        return self._name(f"h{index}")

    def owns(self, name: str) -> bool:
        return parse_tag(name) == self


def parse_tag(name: str) -> RunTag | None:
    """The run a harness name belongs to; None for any other name."""
    match = NAME.match(name)
    return RunTag(int(match["pid"], 16), int(match["seq"])) if match else None


def process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (proc(5), field 22); None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def marker_path(tag: RunTag) -> Path:
    return STATE_DIR / f"{tag.text}.json"


def begin_run() -> RunTag:
    """A new run of this process: its tag, its marker written, counted live. Hold state_lock()."""
    seq = next(_sequence)
    if seq > MAX_SEQ:
        raise RuntimeError(f"this process started more than {MAX_SEQ + 1} multi-host clusters; names would not fit")
    tag = RunTag(os.getpid(), seq)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    marker_path(tag).write_text(json.dumps({"pid": tag.pid, "start": process_start(tag.pid)}))
    _live.add(tag.text)
    return tag


def end_run(tag: RunTag) -> None:
    """The run is torn down: its marker removed, no longer live."""
    marker_path(tag).unlink(missing_ok=True)
    _live.discard(tag.text)


def owner_alive(tag: RunTag) -> bool:
    """Whether the process that made this run still runs (see the module docstring)."""
    if tag.pid == os.getpid():
        return tag.text in _live
    start = process_start(tag.pid)
    if start is None:
        return False
    try:
        recorded = json.loads(marker_path(tag).read_text())["start"]
    except (OSError, ValueError, KeyError):
        return True  # no marker: the pid exists, so assume it is the owner
    return recorded == start


@contextmanager
def state_lock() -> Iterator[None]:
    """Exclusive among harness runs on this machine (flock on STATE_DIR/.lock)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def sweep_dead_runs() -> list[str]:
    """Remove the namespaces, links and markers of runs whose owner is dead; the names removed."""
    namespaces = [name for name in netns_names() if parse_tag(name)]
    links = [name for name in link_names() if parse_tag(name)]
    markers = [path.stem for path in STATE_DIR.glob("*.json")] if STATE_DIR.is_dir() else []
    tags = {
        tag for name in [*namespaces, *links, *(f"{PREFIX}{stem}br" for stem in markers)] if (tag := parse_tag(name))
    }
    removed: list[str] = []
    for tag in sorted(tags, key=lambda t: (t.pid, t.seq)):
        if owner_alive(tag):
            continue
        for name in namespaces:
            if tag.owns(name):
                kill_netns_processes(name)
        # veths before the bridge (deleting one end removes its peer in the namespace), then namespaces.
        for name in sorted((n for n in links if tag.owns(n)), key=lambda n: n.endswith("br")):
            ip("link", "delete", name, check=False)
            removed.append(name)
        for name in namespaces:
            if tag.owns(name):
                ip("netns", "delete", name, check=False)
                removed.append(name)
        marker_path(tag).unlink(missing_ok=True)
    return removed
