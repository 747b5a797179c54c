"""The replica's swap fails closed (a real vLLM CPU engine driven by the replica's own runtime).

A delta is staged the way a hot-load stages it (decoded by the host copy into the shared stage
arena, checked, staged in the engine). Then, inside the pause:

- one staged byte is flipped, so what the engine holds after the swap differs from the snapshot:
  the read-back must refuse it, naming the tensor (ReadBackFailed, which the step reports as a
  non-retryable READ_BACK_FAILED);
- or the "swap" fault point (`replica.faults`) fails between the swap and the read-back;
- or it holds there and the step is canceled (through the activity, as Temporal cancels it).

Each time the engine's tensors, its weight-version label and the host copy go back, the engine
is resumed, the replica keeps its chain, and it answers exactly as before (same logprobs). The
same stage, untouched, then swaps in and is proven.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from contracts.activities import ApplySnapshotInput
from contracts.errors import INJECTED_FAULT, READ_BACK_FAILED
from contracts.records import PromptCachePolicy, SnapshotRef, SnapshotType
from replica import faults
from replica.agent.activities import replica_step
from replica.agent.engine_process import EngineProcess
from replica.agent.engine_rpc import ReadBackFailed
from replica.agent.host_decodes import read_records
from replica.agent.runtime import ReplicaRuntime
from replica.agent.staged import EngineUpdateError
from replica.stage_arena import StageArena
from snapshots.host import HostWeights, checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.engine_weights import fixed_answer, load

pytestmark = pytest.mark.engine

SERVED_NAME = "base"  # conftest's engines serve the model under this name
NAME = "replica-t"
CHAIN = [
    SnapshotRef(identity="v-base", type=SnapshotType.FULL),
    SnapshotRef(identity="v-next", type=SnapshotType.INCREMENTAL),
]
CHAIN_IDS = [link.identity for link in CHAIN]


async def answer(engine: EngineProcess) -> dict[str, Any]:
    return await fixed_answer(engine, SERVED_NAME)


class Replica:
    """The session's engine serving the base model as "v-base", a runtime over it with a host copy
    in shared memory and fault points armed from ``home``, and the delta to "v-next"."""

    def __init__(self, engine: EngineProcess, model_dirs: dict[str, Path], home: Path) -> None:
        self.engine, self.model_dirs, self.home = engine, model_dirs, home
        self.base_sums = checkpoint_checksums(model_dirs["base"])
        self.delta = home / "v-next"
        write_delta(model_dirs["base"], model_dirs["counting"], self.delta, version="v-next", base_version="v-base")
        self.inp = ApplySnapshotInput(hot_load_id="hl-t", identity="v-next", chain=CHAIN, bucket="", path_prefix="")

    async def start(self) -> ReplicaRuntime:
        await load(self.engine, self.model_dirs["base"])
        await self.engine.set_weight_version("v-base")
        host_arena = StageArena(self.home)
        self.host = HostWeights.load(self.model_dirs["base"], allocate=host_arena.allocate)
        self.runtime = ReplicaRuntime(
            name=NAME,
            engine=self.engine,
            host=self.host,
            s3=None,
            workdir=self.home / "work",
            host_arena=host_arena,
            faults_home=self.home,
            deployment="dep-t",
        )
        self.runtime.applied = ["v-base"]
        self.before = await answer(self.engine)
        return self.runtime

    def arm(self, action: str) -> str:
        rule = f"swap-{action}-{uuid.uuid4().hex[:8]}"
        (self.home / faults.FAULTS_FILE).write_text(
            json.dumps({"rules": [{"id": rule, "point": "swap", "replica": NAME, "action": action}]})
        )
        return rule

    def disarm(self) -> None:
        (self.home / faults.FAULTS_FILE).unlink(missing_ok=True)

    async def serves_the_base_as_before(self) -> None:
        assert self.runtime.applied == ["v-base"]
        assert not await self.engine.is_paused()
        assert await self.engine.weight_version() == "v-base"
        assert await self.engine.served_checksums() == self.base_sums
        await self.runtime.settled()
        assert self.host.checksums() == self.base_sums
        assert await answer(self.engine) == self.before

    async def swaps_in_the_delta(self) -> None:
        staged = await self.runtime.stage_update(self.inp, {"v-next": self.delta})
        _, _, verified, breakdown, _ = await self.runtime._swap_in(staged, CHAIN_IDS, PromptCachePolicy.PRESERVE)
        # A vLLM server swaps in four calls, each timed.
        assert {"pause", "label", "swap", "swap_in", "prove", "resume"} <= breakdown.keys(), breakdown
        await self.runtime.settled()
        counting = checkpoint_checksums(self.model_dirs["counting"])
        assert verified == len(staged.names)
        assert self.runtime.applied == CHAIN_IDS
        assert await self.engine.weight_version() == "v-next"
        assert await self.engine.served_checksums() == counting
        assert self.host.checksums() == counting
        assert await answer(self.engine) != self.before


@pytest.fixture
async def replica(engine: EngineProcess, model_dirs: dict[str, Path], tmp_path: Path) -> AsyncIterator[Replica]:
    r = Replica(engine, model_dirs, tmp_path)
    await r.start()
    yield r
    # As an agent does when it stops: its decode record in /dev/shm does not outlive it.
    r.runtime.withdraw_decode()
    assert not [p for p, rec in read_records(r.runtime.arena.directory) if rec.get("arena") == r.runtime.arena.path]


async def test_a_swap_whose_read_back_differs_rolls_back_weights_label_and_host_copy(replica: Replica) -> None:
    runtime = replica.runtime
    staged = await runtime.stage_update(replica.inp, {"v-next": replica.delta})
    assert staged.names and staged.arena_offsets, "the delta was not staged through the arena"
    victim = staged.names[0]
    flipped = runtime.arena.view(staged.arena_offsets[victim], 1)
    flipped[0] ^= 1  # after the decode checked it: only the read-back inside the pause can see it
    with pytest.raises(ReadBackFailed) as err:
        await runtime._swap_in(staged, CHAIN_IDS, PromptCachePolicy.PRESERVE)
    message = str(err.value)
    assert err.value.tensors == [victim]
    assert victim in message and "it serves its previous weights (v-base" in message, message
    await replica.serves_the_base_as_before()

    # The step reports it as READ_BACK_FAILED, not retried, naming the tensor.
    flipped[0] ^= 1
    staged = await runtime.stage_update(replica.inp, {"v-next": replica.delta})
    flipped = runtime.arena.view(staged.arena_offsets[victim], 1)
    flipped[0] ^= 1
    env = ActivityEnvironment()
    with pytest.raises(ApplicationError) as app_err:
        await env.run(replica_step, runtime, lambda: runtime._swap_in(staged, CHAIN_IDS, PromptCachePolicy.PRESERVE))
    assert app_err.value.type == READ_BACK_FAILED and app_err.value.non_retryable
    assert victim in app_err.value.message and app_err.value.details == ([victim],)
    await replica.serves_the_base_as_before()

    flipped[0] ^= 1
    await replica.swaps_in_the_delta()


async def test_a_fault_at_the_swap_rolls_back_like_a_failed_read_back(replica: Replica) -> None:
    """The "swap" fault point fails after the engine swapped the stage in, before its read-back:
    the step fails with the injected fault (its type and retry policy kept) and the replica
    serves its previous weights."""
    runtime = replica.runtime
    rule = replica.arm("fail")
    staged = await runtime.stage_update(replica.inp, {"v-next": replica.delta})
    with pytest.raises(ApplicationError) as err:
        await runtime._swap_in(staged, CHAIN_IDS, PromptCachePolicy.PRESERVE)
    assert faults._fired[rule] == 1
    assert err.value.type == INJECTED_FAULT and err.value.non_retryable
    assert "at swap on replica replica-t" in err.value.message
    assert "it serves its previous weights (v-base" in err.value.message, err.value.message
    await replica.serves_the_base_as_before()

    replica.disarm()
    await replica.swaps_in_the_delta()


async def test_a_hold_at_the_swap_ends_when_the_step_is_canceled(replica: Replica) -> None:
    """A "hold" at the swap keeps the engine paused with the stage swapped in; canceling the
    step (the activity's cancel, as Temporal delivers it) ends the hold, rolls back and resumes."""
    runtime = replica.runtime
    rule = replica.arm("hold")
    staged = await runtime.stage_update(replica.inp, {"v-next": replica.delta})
    env = ActivityEnvironment()
    step = asyncio.ensure_future(
        env.run(replica_step, runtime, lambda: runtime._swap_in(staged, CHAIN_IDS, PromptCachePolicy.PRESERVE))
    )
    while faults._fired[rule] == 0:  # the hold is reached inside the pause
        assert not step.done(), step
        await asyncio.sleep(0.05)
    assert await replica.engine.is_paused()
    assert await replica.engine.weight_version() == "v-next"  # labelled, swapped, not yet proven
    env.cancel()
    with pytest.raises(EngineUpdateError, match="canceled while held at the fault point swap"):
        await asyncio.wait_for(step, 120)  # guards a hang only
    assert (replica.home / faults.FAULTS_FILE).exists()  # the rule still holds: the cancel ended it
    await replica.serves_the_base_as_before()

    replica.disarm()
    await replica.swaps_in_the_delta()
