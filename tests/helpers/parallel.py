"""How the suite runs on pytest-xdist's workers (`make test`: ``-n 2 --dist loadscope
--no-loadscope-reorder``), and in one process when run without ``-n``.

Each worker is a whole test session of its own: its embedded stack, its Temporal dev server, its
OTLP receiver, its engine watch (at most ``MAX_ENGINES`` of its own engines) and its pool of
shared deployments (tests/helpers/deployments.py). What the controller hands a worker is a
*unit*, run whole on that worker, in the order of collection:

- a module that starts the stack or an engine (its module-scoped fixtures start once);
- each test of a module that starts neither (the unit tests): these balance the two workers;
- each test of a module marked ``unit_per_test`` (long stack tests that share nothing but the
  worker's stack, such as the model families'): they balance the workers among the heavy units;
- the modules that use one pooled deployment (``rolling``, ``gw``, ``vllm_gw``) form one unit
  (``pool:<key>``): the deployment is created once, on that worker;
- the modules that make network-namespace hosts form one unit (``multihost``): one set of hosts
  exists at a time;
- units that make hosts, use a pooled deployment, or start the stack or an engine come first, in
  that order, and the unit tests last, where they fill the time while the other worker finishes
  its last slow unit.

The workers collect; the controller only sees node ids. So each worker writes the module → unit
map it computed (tests/conftest.py) to the file the controller named in ``UNITS_ENV``, and
``UnitScheduling`` (xdist's ``loadscope`` scheduler with that map as its scope) reads it when it
schedules, after every worker's collection. (xdist's own ``loadgroup`` renames node ids, which
pytest 9 no longer allows: its groups are silently ignored.) A worker's summary (engines, shared
deployments, READY checks) travels to the controller in ``config.workeroutput``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

WORKER_ENV = "PYTEST_XDIST_WORKER"  # gw0, gw1, ...: set by xdist in each worker
WORKER_COUNT_ENV = "PYTEST_XDIST_WORKER_COUNT"
UNITS_ENV = "ROLLOUTS_TEST_UNITS_FILE"  # set by the controller, inherited by its workers
MULTIHOST_UNIT = "multihost"
EACH_TEST = "each:"  # the unit of a ``unit_per_test`` module: each of its tests a scope of its own


def worker() -> str:
    """This process's xdist worker id, or "" when the suite runs in one process."""
    return os.environ.get(WORKER_ENV, "")


def worker_slot() -> tuple[int, int]:
    """(index, count) of this worker among all; (0, 1) without xdist."""
    name = worker()
    if not name.startswith("gw"):
        return 0, 1
    return int(name[2:]), max(1, int(os.environ.get(WORKER_COUNT_ENV, "1")))


def is_controller(config) -> bool:
    """True in the process that hands tests to xdist's workers (it runs none itself)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def unit_of(
    module: str,
    pooled: frozenset[str],
    multihost: bool,
    heavy: bool,
    pool_order: tuple[str, ...],
    per_test: bool = False,
) -> str:
    """The unit a module's tests run in ("" or ``EACH_TEST``: each test is a unit of its own)."""
    if multihost:
        return MULTIHOST_UNIT
    if pooled:
        return "pool:" + min(pooled, key=pool_order.index)
    if heavy and per_test:
        return EACH_TEST + module
    return module if heavy else ""


def unit_rank(unit: str) -> int:
    """Lower runs first: the multi-host hosts, then the pooled deployments, then other modules
    that start the stack or engines (whole, or one test each), then the rest (one test each:
    ``unit`` is "")."""
    if unit == MULTIHOST_UNIT:
        return 0
    if unit.startswith("pool:"):
        return 1
    return 2 if unit else 3


def share_units() -> None:
    """In the controller: name the file the workers write their module → unit map to."""
    handle, path = tempfile.mkstemp(prefix="rollouts-test-units-", suffix=".json")
    os.close(handle)
    os.environ[UNITS_ENV] = path


def forget_units() -> None:
    """In the controller, after the run: remove the file."""
    if path := os.environ.pop(UNITS_ENV, None):
        Path(path).unlink(missing_ok=True)


def publish_units(units: dict[str, str]) -> None:
    """In a worker: write the map (every worker collects the same tests and writes the same)."""
    if not (path := os.environ.get(UNITS_ENV)) or not worker():
        return
    part = Path(f"{path}.{worker()}")
    part.write_text(json.dumps(units))
    part.replace(path)


class UnitScheduling(LoadScopeScheduling):
    """xdist's ``loadscope`` with the workers' units as scopes."""

    _units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            path = os.environ.get(UNITS_ENV, "")
            self._units = json.loads(Path(path).read_text() or "{}") if path else {}
        module = nodeid.split("::", 1)[0]
        unit = self._units.get(module, module)
        return nodeid if not unit or unit.startswith(EACH_TEST) else unit
