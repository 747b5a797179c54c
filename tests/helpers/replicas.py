"""What the real-replica tests (tests/e2e/) read and drive on the running stack: hot-loads through
the REST API, each replica's engine read back directly (with the engine secret the gateway
derives), the Temporal workflow of an operation, and the fault points of ``replica/faults.py``.

- ``hot_load`` / ``start_hot_load``: a FULL or INCREMENTAL hot-load (waited for, or only started);
  ``hot_load_replicas``: its replica entries in walk order.
- ``replicas_of`` (the deployment workflow's memo), ``engines`` (the same, each with its
  ``engineSecret``, by name) and ``walk_order`` (by zone, then name: the hot-load's order).
- ``control``: a Dynamo worker's control route (``leave`` takes it out of Dynamo's routing pool).
- ``attach`` (one replica's engine) and ``complete`` (a completion that engine alone serves).
- ``served_checksums``, ``engine_label``, ``paused``, ``running_requests``: one engine's served
  bytes, weight-version label, pause state, and the requests it was running after its last step
  (``engine_running`` for an ``EngineProcess``; while it is paused with ``keep`` these are the
  requests frozen in the pause).
- ``assert_every_replica_serves``: every replica's engine serves exactly a checkpoint's tensors.
- ``hot_load_workflow_status``: how Temporal describes the operation's workflow once it closed.
- ``requests_frozen_in_first_pause``: a hot-load whose first replica's swap is held in its pause
  while requests sent through Dynamo (the other replicas out of its pool) run there.
- ``faults``: a context that writes ``faults.json`` into the stack's home and removes it on exit;
  ``Fault.fired`` says whether the named replica's agent logged the rule's firing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowExecutionStatus

from common.settings import Settings, temporal_client
from contracts.memo import replica_list
from contracts.names import deployment_workflow_id, dynamo_model, hot_load_workflow_id
from contracts.records import TERMINAL_HOT_LOAD_STATES
from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_process import EngineProcess
from replica.faults import FAULTS_FILE
from rollouts.client import hot_load_body as client_hot_load_body
from snapshots.host import checkpoint_checksums
from snapshots.regions import ServedWeights
from tests.helpers.stack_fixtures import Api
from workers.base_model import load_checkpoint

# The shared 3-replica deployment's hot-load path prefix (tests/e2e/conftest.py `rolling`).
ROLLING_PREFIX = "checkpoints/rolling"
# Each engine step's delay while requests must stay in flight across a pause (step_delay).
STEP_DELAY_S = 0.025


# ------------------------------------------------------------------------------ hot-loads
def hot_load_body(dep_id: str, identity: str, previous: str | None, **extra: Any) -> dict:
    return {**client_hot_load_body(dep_id, identity, previous_identity=previous), **extra}


def start_hot_load(api: Api, dep_id: str, identity: str, previous: str | None, **extra: Any) -> str:
    """POST a hot-load; returns its id without waiting."""
    r = api.call("POST", "/hotLoads", json=hot_load_body(dep_id, identity, previous, **extra))
    assert r.status_code == 200, r.text
    return r.json()["hotLoad"]["spec"]["id"]


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None, **extra: Any) -> dict:
    """POST a hot-load and wait until it is terminal; returns the operation."""
    return api.wait_hot_load(start_hot_load(api, dep_id, identity, previous, **extra))


def hot_load_replicas(api: Api, hl_id: str) -> list[dict]:
    r = api.call("GET", f"/hotLoads/{hl_id}/replicas")
    assert r.status_code == 200, r.text
    return r.json()["replicas"]


def wait_replica_state(api: Api, hl_id: str, name: str, state: str, timeout: float = 600) -> list[dict]:
    """Poll the operation's replica entries until `name` is in `state`; returns all entries."""
    deadline = time.monotonic() + timeout
    while True:
        reps = hot_load_replicas(api, hl_id)
        if any(r["name"] == name and r["state"] == state for r in reps):
            return reps
        hl = api.call("GET", f"/hotLoads/{hl_id}").json()["hotLoad"]
        assert hl["status"]["state"] not in TERMINAL_HOT_LOAD_STATES, (f"{name} never {state}", hl["status"], reps)
        assert time.monotonic() < deadline, f"{name} not {state} after {timeout:.0f}s: {reps}"
        time.sleep(0.2)


def hot_load_workflow_status(settings: Settings, hl_id: str, timeout: float = 60) -> WorkflowExecutionStatus:
    """How Temporal describes the operation's workflow once it has closed: the API shows the
    operation's final state a moment before its workflow returns (RUNNING after ``timeout``)."""

    async def read() -> WorkflowExecutionStatus:
        client = await temporal_client(settings)
        handle = client.get_workflow_handle(hot_load_workflow_id(settings.organization_id, hl_id))
        deadline = time.monotonic() + timeout
        while (status := (await handle.describe()).status) == WorkflowExecutionStatus.RUNNING:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return status

    return asyncio.run(read())


# ------------------------------------------------------------------------------ replicas
def replicas_of(settings: Settings, dep_id: str) -> list[dict]:
    """The deployment's replicas as its workflow's memo lists them."""

    async def read() -> list[dict]:
        client = await temporal_client(settings)
        desc = await client.get_workflow_handle(deployment_workflow_id(settings.organization_id, dep_id)).describe()
        return replica_list(await desc.memo())

    return asyncio.run(read())


def engines(settings: Settings, dep_id: str) -> list[dict]:
    """The deployment's replicas by name, each with its engine's secret (``engineSecret``,
    derived from the stack's settings as the gateway does) and the stack's Dynamo frontend
    (``dynamoFrontendUrl``, through which a Dynamo worker serves, ``dynamoModel``, the
    deployment's model there, ``dynamoTls``, the stack's certificates it is reached with, and
    ``dynamoRequestSecret``, what every inference request for its workers carries)."""
    workflow_id = deployment_workflow_id(settings.organization_id, dep_id)
    replicas = [
        {
            **r,
            "engineSecret": settings.engine_secret(workflow_id, r["name"]),
            "dynamoFrontendUrl": settings.dynamo_frontend_url,
            "dynamoModel": dynamo_model(workflow_id),
            "dynamoTls": settings.dynamo_tls(),
            "dynamoRequestSecret": settings.dynamo_request_secret(workflow_id),
        }
        for r in replicas_of(settings, dep_id)
    ]
    return sorted(replicas, key=lambda r: r["name"])


def walk_order(settings: Settings, dep_id: str) -> list[dict]:
    """The replicas in the order a hot-load walks them: by zone, then name."""
    return sorted(engines(settings, dep_id), key=lambda r: (r["zone"], r["name"]))


def attach(replica: dict) -> EngineProcess:
    """The replica's engine, attached: a Dynamo worker (with its id and the frontend, so that
    ``/v1/...`` requests reach it alone) or a vLLM server."""
    if replica.get("dynamoWorker"):
        return DynamoEngineProcess.attach(
            replica["engineUrl"],
            pid=replica["enginePid"],
            secret=replica["engineSecret"],
            served_model_name=replica.get("dynamoModel"),
            worker_id=int(replica["dynamoWorker"], 16),
            frontend_url=replica.get("dynamoFrontendUrl"),
            tls=replica.get("dynamoTls"),
            request_secret=replica.get("dynamoRequestSecret"),
        )
    return EngineProcess.attach(replica["engineUrl"], pid=replica["enginePid"], secret=replica["engineSecret"])


def step_delay(replica: dict, seconds: float) -> None:
    """Slow each step of the replica's engine by ``seconds`` (0: full speed again)."""
    _with_engine(replica, lambda e: e.collective_rpc("set_step_delay", seconds))


def _with_engine(replica: dict, read: Any) -> Any:
    async def run() -> Any:
        engine = attach(replica)
        try:
            return await read(engine)
        finally:
            await engine.aclose()

    return asyncio.run(run())


def complete(replica: dict, body: dict[str, Any], timeout: float = 120) -> dict:
    """A completion (``body`` without ``model``) that this replica's engine alone serves."""

    async def serve(engine: EngineProcess) -> dict:
        model = (await engine.models())[0]
        return (await engine.request("POST", "/v1/completions", json={"model": model, **body}, timeout=timeout)).json()

    return _with_engine(replica, serve)


def served_checksums(replica: dict, names: list[str] | None = None) -> dict[str, str]:
    """The Adler-32 of every tensor the engine serves, read back from its memory."""
    return _with_engine(replica, lambda e: e.checksums(names))


def served_weights(replica: dict) -> ServedWeights:
    """What every rank of the replica's engine serves (`snapshots.regions`): read back from memory."""
    return _with_engine(replica, lambda e: e.served_weights())


def assert_every_replica_serves(settings: Settings, dep_id: str, checkpoint: Path) -> None:
    """Every tensor of every replica's engine, read back, is ``checkpoint``'s (no replica serves
    a mix; a tensor-parallel engine's shards against the same regions of the checkpoint's
    tensors); a failure names the replica and the tensors that differ."""
    expected = checkpoint_checksums(checkpoint)
    tensors = load_checkpoint(checkpoint)
    for replica in engines(settings, dep_id):
        served = served_weights(replica)
        extra = sorted((served.checksums.keys() | served.regions.keys()) - expected.keys())
        wrong = served.differing(sorted(expected), expected, tensors.__getitem__) + extra
        assert not wrong, f"{replica['name']} serves {len(wrong)} tensor(s) not of {checkpoint.name}: {wrong[:8]}"


def engine_label(replica: dict) -> str | None:
    """The engine's weight-version label (the identity its answers name)."""
    return _with_engine(replica, lambda e: e.weight_version())


def paused(replica: dict) -> bool:
    return _with_engine(replica, lambda e: e.is_paused())


async def engine_running(engine: EngineProcess) -> int:
    """The requests the engine was running after its last step (vLLM's ``num_requests_running``
    gauge): each has sampled at least one token and not finished. While the engine is paused with
    ``keep``, these are the requests frozen in the pause."""
    text = (await engine.request("GET", "/metrics")).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running{")
        )
    )


def running_requests(replica: dict) -> int:
    return _with_engine(replica, engine_running)


def control(replica: dict, route: str) -> None:
    """Call a Dynamo worker's control route (``leave`` / ``join`` ...) as its agent does."""
    _with_engine(replica, lambda e: e.control(route))


# ------------------------------------------------------------------------------ faults
@dataclass(frozen=True)
class Fault:
    """One rule of ``faults.json`` (see replica/faults.py); ``id`` is unique per test run."""

    point: str
    replica: str
    action: str
    id: str = ""

    def rule(self) -> dict[str, Any]:
        return {"id": self.id, "point": self.point, "replica": self.replica, "action": self.action, "times": 1}

    def fired(self, settings: Settings, dep_id: str) -> bool:
        """Whether the replica's agent logged this rule firing (replica/faults.py `hit`)."""
        log = settings.home_path / "replicas" / dep_id / self.replica / "replica.log"
        return log.exists() and f"fault {self.id} fires at {self.point} on {self.replica}" in log.read_text()

    def wait_fired(self, settings: Settings, dep_id: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not self.fired(settings, dep_id):
            assert time.monotonic() < deadline, f"fault {self} did not fire in {timeout:.0f}s"
            time.sleep(0.2)


def fault(point: str, replica: str, action: str) -> Fault:
    return Fault(point, replica, action, id=f"{point}-{uuid.uuid4().hex[:8]}")


def write_faults(settings: Settings, rules: list[Fault]) -> None:
    path: Path = settings.home_path / FAULTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rules": [f.rule() for f in rules]}))
    tmp.replace(path)  # an agent reading it never sees half a file


@contextlib.contextmanager
def faults(settings: Settings, *rules: Fault) -> Iterator[None]:
    """Arm `rules` for the duration of the block; the file is removed on exit, whatever happens
    (which also releases a hold)."""
    write_faults(settings, list(rules))
    try:
        yield
    finally:
        (settings.home_path / FAULTS_FILE).unlink(missing_ok=True)


@dataclass
class HeldPause:
    """What ``requests_frozen_in_first_pause`` saw: the hot-load once it ended, whether the first
    replica was paused while its swap was held, and how many requests it had frozen there."""

    hot_load: dict | None
    was_paused: bool
    frozen: int


def _wait_alone_in_pool(replica: dict, timeout: float = 60.0) -> bool:
    """Whether, within ``timeout``, the Dynamo discovery of ``replica``'s worker lists only its
    own ``generate`` instance."""
    deadline = time.monotonic() + timeout
    while True:
        ids = _with_engine(replica, lambda e: e.instances())
        if len(ids) == 1:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def requests_frozen_in_first_pause(
    settings: Settings, api: Api, dep_id: str, start: Any, threads: list[Any], started: list[Any]
) -> HeldPause:
    """Requests under way on the first replica of the walk when its pause begins.

    ``start()`` creates the hot-load and returns its id; its first replica's step stages the
    update and is held just before its pause (fault point ``pause``). The other replicas leave
    Dynamo's routing pool (as a pause takes one out; waited for until the first replica's own
    discovery lists it alone) while ``threads`` (each sending a request)
    start, until every ``started`` event is set, so the requests run on the first replica, its
    engine's steps slowed (``step_delay``) until the pause holds; the
    step then goes on into its pause at once (its stage is ready, so the requests need only
    outlast a file poll) and is held again inside it, at its swap, where the others join again
    and the engine says whether it is paused and how many requests it froze. Every thread is
    joined before this returns."""
    first, *others = walk_order(settings, dep_id)
    before_pause = fault("pause", first["name"], "hold")
    hold = fault("swap", first["name"], "hold")
    hl_id, frozen, was_paused = None, -1, False
    try:
        with faults(settings, before_pause, hold):
            hl_id = start()
            before_pause.wait_fired(settings, dep_id)
            for other in others:
                control(other, "leave")
            # Dynamo's discovery (the frontend's as the worker's: both watch the same directory)
            # learns of the leaves a moment later; requests sent before would still go to the
            # others, so wait until the first replica's own view lists it alone.
            alone = _wait_alone_in_pool(first)
            assert alone, f"the others left Dynamo's pool but {first['name']}'s discovery still lists them"
            # Its engine's steps slowed until the pause holds (replica/engine/step_delay.py):
            # the requests (1,900 tokens in about 9 s at full speed) then outlast any stall of
            # this machine before the pause reaches the engine; the callers check that they did.
            step_delay(first, STEP_DELAY_S)
            try:
                for t in threads:
                    t.start()
                assert all(e.wait(600) for e in started)
                # Into the pause at once (its swap stays held); the others' joins can take
                # seconds each while they serve, so they come after.
                write_faults(settings, [hold])
                hold.wait_fired(settings, dep_id)
            finally:
                step_delay(first, 0)
                # At once: each join waits on a worker that is serving (seconds), inside the hold.
                with ThreadPoolExecutor(max(1, len(others))) as pool:
                    list(pool.map(lambda other: control(other, "join"), others))
            was_paused, frozen = paused(first), running_requests(first)
    finally:
        hl = api.wait_hot_load(hl_id) if hl_id else None  # the next test finds no hot-load open
        for t in threads:
            t.join(900)
    return HeldPause(hl, was_paused, frozen)
