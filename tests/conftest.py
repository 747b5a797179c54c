"""Shared fixtures and the suite's rules.

- `make test` runs two pytest-xdist workers, each a test session of its own (its stack, its
  engines, its pool); tests/helpers/parallel.py says which tests run together and in which order.
  Everything below holds per session, that is per worker.
- The embedded stack is started once per test session, on free loopback ports in a temporary
  home, and stopped by pid at the end. The session starts without another stack's variables
  (``common.settings.without_stack_env``: a ``stack.env`` sourced in the runner's shell), so the
  tests' own clients (``Settings.load``, ``rollouts`` commands, cwtrain) reach the session's
  stack; the stack itself needs no such help (workers/stack.py). Its processes (and the replicas they start) export
  their spans over OTLP/HTTP to the session's real receiver (``otlp``, tests/helpers/otlp_receiver.py).
- Markers come from fixtures: a test that uses ``stack`` or ``seaweed`` (directly or through
  another fixture) is marked ``stack``; one that uses an engine fixture (``ENGINE_FIXTURES``) is
  marked ``engine``. One that uses the multi-host harness's ``cluster`` or ``make_cluster``
  (tests/multihost/conftest.py) is marked ``multihost``.
  ``make test-fast`` deselects ``stack`` and ``engine``. A test marked neither that still starts a vLLM engine or
  SeaweedFS fails, naming the process (the watcher below attributes each new process to the test
  running when it first saw it; both take seconds to start): a new test cannot slip into the fast
  run by mistake.
- At most three vLLM engines alive at once (tests/helpers/engines.py watches this session's
  processes every second; the test running when a fourth appeared fails). The shared deployments
  live in tests/helpers/deployments.py's pool, one at a time: the modules that use one pooled
  deployment run together, and the pool is released before a module that starts engines
  without it.
"""

from __future__ import annotations

import os
import time

import pytest

from common import envs
from common.settings import without_stack_env
from tests.helpers import ready
from tests.helpers.deployments import POOL, POOLED_FIXTURES
from tests.helpers.devices import cuda_available
from tests.helpers.engine_cache import forget_engine_cache, share_engine_cache
from tests.helpers.engines import EngineWatch, mark_session
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.parallel import (
    UnitScheduling,
    forget_units,
    is_controller,
    publish_units,
    share_units,
    unit_of,
    unit_rank,
    worker,
)
from tests.helpers.stack_fixtures import start_stack
from tests.helpers.temporal_server import temporal_env  # noqa: F401 - one dev server for every suite that needs one

# Fixtures that start the embedded stack or its SeaweedFS (tests/snapshots/conftest.py).
STACK_FIXTURES = frozenset({"stack", "seaweed"})
# Fixtures that start a vLLM engine of their own (tests/replica/conftest.py, tests/gateway/test_weight_spans.py).
ENGINE_FIXTURES = frozenset({"engine", "engine_b", "running_engine"})
# Fixtures that make network-namespace hosts (tests/multihost/conftest.py).
MULTIHOST_FIXTURES = frozenset({"cluster", "make_cluster"})

WATCH = EngineWatch()
TEST_KV_CACHE_BYTES = 256 << 20
# module node id -> (the pooled fixtures its tests use, whether they start the stack or an engine)
MODULES: dict[str, tuple[frozenset[str], bool]] = {}
# Under xdist, the controller's copy of each worker's summary (engines, pool, READY checks).
SUMMARY_KEY = "rollouts_summary"
SUMMARIES: dict[str, dict] = {}
STARTED = time.monotonic()  # when this process's session began: each worker's summary says how long it ran


def pytest_configure(config: pytest.Config) -> None:
    for name in set(os.environ) - set(without_stack_env(os.environ)):
        del os.environ[name]
    # The suite's models are tiny: a 1 GiB KV cache per engine only costs its allocation and release.
    os.environ.setdefault(envs.ROLLOUTS_CPU_KV_CACHE_BYTES.name, str(TEST_KV_CACHE_BYTES))
    mark_session(worker())
    if is_controller(config):
        share_units()
    if not worker():  # the controller, or the one process without xdist: before any worker starts
        # The architectures' records at once: for a session of xdist workers that may start engines.
        share_engine_cache(engines=is_controller(config) and "not engine" not in (config.option.markexpr or ""))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> UnitScheduling | None:
    """Whole units, in collection order (tests/helpers/parallel.py), for ``--dist loadscope``."""
    return UnitScheduling(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_sessionstart(session: pytest.Session) -> None:
    if not is_controller(session.config):  # the controller of xdist's workers runs no test
        WATCH.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    WATCH.stop()
    if is_controller(session.config):
        forget_units()
    if not worker():
        forget_engine_cache()
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput[SUMMARY_KEY] = _summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller keeps each worker's summary (pytest-xdist's hook)."""
    if summary := getattr(node, "workeroutput", {}).get(SUMMARY_KEY):
        SUMMARIES[node.gateway.id] = summary


def _summary() -> dict:
    return {
        "peak": WATCH.peak,
        "started": WATCH.started,
        "samples": WATCH.samples,
        "sampling_s": WATCH.sample_seconds,
        "created": POOL.created,
        "ready": ready.counts(),
        "ran_s": time.monotonic() - STARTED,
    }


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    summaries = dict(SUMMARIES) if is_controller(config) else {"": _summary()}
    for name, summary in sorted(summaries.items()):
        who = f"{name}: " if name else ""
        if summary["samples"]:
            terminalreporter.write_line(
                f"{who}ran {summary.get('ran_s', 0):.0f} s; vLLM engines: {summary.get('started', 0)} started, at most "
                f"{summary['peak']} alive at once "
                f"({summary['samples']} samples, "
                f"{summary['sampling_s']:.2f} s CPU spent sampling); shared deployments created: "
                f"{summary['created'] or 'none'}"
            )
    if line := ready.tally([summary["ready"] for summary in summaries.values()]):
        terminalreporter.write_line(line)


def _module_id(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & STACK_FIXTURES:
            item.add_marker(pytest.mark.stack)
        if names & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
        if names & MULTIHOST_FIXTURES:
            item.add_marker(pytest.mark.multihost)
        if any(item.iter_markers("gpu")) and not cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)"))
    pooled: dict[str, set[str]] = {}
    heavy: dict[str, bool] = {}
    for item in items:
        module = _module_id(item)
        pooled.setdefault(module, set()).update(set(getattr(item, "fixturenames", ())) & set(POOLED_FIXTURES))
        heavy[module] = heavy.get(module, False) or any(item.iter_markers("stack")) or any(item.iter_markers("engine"))
    MODULES.update({m: (frozenset(pooled[m]), heavy[m]) for m in pooled})

    # Whole units (tests/helpers/parallel.py): the multi-host modules, then each pooled deployment's
    # modules together, then the other modules that start the stack or engines, then the rest.
    folders: dict[str, int] = {}
    for item in items:
        folders.setdefault(str(item.path.parent), len(folders))
    multihost = {_module_id(item) for item in items if any(item.iter_markers("multihost"))}
    per_test = {_module_id(item) for item in items if any(item.iter_markers("unit_per_test"))}
    units = {m: unit_of(m, pooled[m], m in multihost, heavy[m], POOLED_FIXTURES, m in per_test) for m in pooled}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int, int, int]:
        index, item = indexed
        module = _module_id(item)
        used = [POOLED_FIXTURES.index(name) for name in pooled[module]]
        return (
            unit_rank(units[module]),
            min(used, default=len(POOLED_FIXTURES)),
            folders[str(item.path.parent)],
            index,
        )

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    publish_units(units)


@pytest.fixture(scope="module", autouse=True)
def _engine_room(request: pytest.FixtureRequest) -> None:
    """Before a module that starts engines without the live pooled deployment: release it."""
    used, heavy = MODULES.get(request.node.nodeid, (frozenset(), False))
    if POOL.key is not None and heavy and POOL.key not in used:
        POOL.release()


def _check(item: pytest.Item, phase: str) -> None:
    if excess := WATCH.take_excess():
        pytest.fail(excess, pytrace=False)
    if phase != "teardown" and not any(item.iter_markers("stack")) and not any(item.iter_markers("engine")):
        if started := WATCH.started_during(item.nodeid):
            pytest.fail(
                f"{item.nodeid} is marked neither `stack` nor `engine` but started "
                + "; ".join(f"pid {p.pid}: {p.cmdline[:120]}" for p in started)
                + ": use the `stack` fixture or an engine fixture, or mark it",
                pytrace=False,
            )


def _watched(item: pytest.Item, phase: str):
    """The body of the three phase wrappers below: the engine watch follows ``item`` through
    ``phase``, then ``_check`` judges what the phase started."""
    WATCH.enter(item.nodeid, phase)
    result = yield
    _check(item, phase)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _watched(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _watched(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    return (yield from _watched(item, "teardown"))


@pytest.fixture(scope="session")
def otlp():
    """A real OTLP/HTTP receiver that the stack's processes export their spans to."""
    with OtlpReceiver() as receiver:
        yield receiver


# What the stack's processes (and the replicas their node agent starts) inherit: export spans
# over OTLP/HTTP to the session's receiver, in batches every half second.
def _otlp_env(url: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
    }


@pytest.fixture(scope="session")
def stack(tmp_path_factory, otlp):
    home = tmp_path_factory.mktemp("rollouts-home")
    with pytest.MonkeyPatch.context() as env:  # the stack's processes only, not this one
        for name, value in _otlp_env(otlp.url).items():
            env.setenv(name, value)
        stack, settings = start_stack(home)
    try:
        yield settings
    finally:
        try:
            POOL.release()
        finally:
            stack.down(say=lambda line: print(line, flush=True))
