"""How the suite runs on pytest-xdist's workers (`make test`: ``-n 2 --dist loadgroup
--no-loadscope-reorder``), and in one process when run without ``-n``.

Each worker is a whole test session of its own: its embedded stack, its Temporal dev server, its
OTLP receiver, its engine watch (at most ``MAX_ENGINES`` of its own engines) and its pool of
shared deployments (tests/helpers/deployments.py). What xdist schedules is a *unit*, run whole on
one worker, in the order of collection:

- a module's tests stay together (xdist's default scope), so a module's fixtures start once;
- the modules that use one pooled deployment (``rolling``, ``gw``, ``vllm_gw``) form one unit
  (``pool:<key>``): the deployment is created once, on that worker;
- the modules that make network-namespace hosts form one unit (``multihost``): one set of hosts
  exists at a time;
- units that start the stack, an engine or hosts come first, heaviest kinds first, and the unit
  tests last, where they fill the gap while the other worker finishes its last slow unit.

``unit_order`` gives that order; tests/conftest.py sorts the collection by it and marks each
test's ``xdist_group``. A worker's summary (engines, shared deployments, READY checks) travels to
the controller in ``config.workeroutput`` and is printed there.
"""

from __future__ import annotations

import os

WORKER_ENV = "PYTEST_XDIST_WORKER"  # gw0, gw1, ...: set by xdist in each worker
WORKER_COUNT_ENV = "PYTEST_XDIST_WORKER_COUNT"
MULTIHOST_UNIT = "multihost"


def worker() -> str:
    """This process's xdist worker id, or "" when the suite runs in one process."""
    return os.environ.get(WORKER_ENV, "")


def worker_slot() -> tuple[int, int]:
    """(index, count) of this worker among all; (0, 1) without xdist."""
    name = worker()
    if not name.startswith("gw"):
        return 0, 1
    return int(name[2:]), max(1, int(os.environ.get(WORKER_COUNT_ENV, "1")))


def unit_of(module: str, pooled: frozenset[str], multihost: bool, pool_order: tuple[str, ...]) -> str | None:
    """The xdist group of a module's tests, or None for a module of its own."""
    if multihost:
        return MULTIHOST_UNIT
    if pooled:
        return "pool:" + min(pooled, key=pool_order.index)
    return None


def unit_rank(unit: str | None, heavy: bool) -> int:
    """Lower runs first: the multi-host hosts, then the pooled deployments, then other modules
    that start the stack or engines, then the rest."""
    if unit == MULTIHOST_UNIT:
        return 0
    if unit is not None:
        return 1
    return 2 if heavy else 3


def is_controller(config) -> bool:
    """True in the process that hands tests to xdist's workers (it runs none itself)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
