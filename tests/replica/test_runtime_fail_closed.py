"""The replica's swap fails closed (a real vLLM CPU engine driven by the replica's own runtime).

A delta is staged the way a hot-load stages it (decoded by the host copy into the shared stage
arena, checked, staged in the engine); then one staged byte is flipped, so what the engine
will hold after the swap differs from the snapshot. The read-back inside the pause must refuse
it: the engine's tensors, its weight-version label and the host copy go back, the replica keeps
its chain, and the engine answers exactly as before (same logprobs). The same stage unflipped
then swaps in and is proven.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from contracts.activities import ApplySnapshotInput
from contracts.records import PromptCachePolicy, SnapshotRef, SnapshotType
from replica.agent import EngineUpdateError, ReplicaRuntime
from replica.engine import EngineProcess
from replica.stage_arena import StageArena
from snapshots.host import HostWeights, checkpoint_checksums
from snapshots.writer import write_delta
from workers.base_model import checkpoint_files

pytestmark = pytest.mark.engine

SERVED_NAME = "base"  # conftest's engines serve the model under this name


async def answer(engine: EngineProcess) -> dict[str, Any]:
    """A fixed greedy completion with its top-5 logprobs (fresh cache salt: no prefix reuse)."""
    body = {"model": SERVED_NAME, "prompt": [100, 101, 102], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 5, "cache_salt": uuid.uuid4().hex}
    choice = (await engine.request("POST", "/v1/completions", json=body)).json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["top_logprobs"]}


async def test_a_swap_whose_read_back_differs_rolls_back_weights_label_and_host_copy(
    engine: EngineProcess, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    base, counting = model_dirs["base"], model_dirs["counting"]
    await engine.load_weights_from_files(checkpoint_files(base))
    await engine.set_weight_version("v-base")
    host_arena = StageArena(tmp_path)
    host = HostWeights.load(base, allocate=host_arena.allocate)
    runtime = ReplicaRuntime(name="replica-t", engine=engine, host=host, s3=None, workdir=tmp_path / "work",
                             host_arena=host_arena)
    runtime.applied = ["v-base"]
    delta = tmp_path / "v-next"
    write_delta(base, counting, delta, version="v-next", base_version="v-base")
    chain = [SnapshotRef(identity="v-base", type=SnapshotType.FULL),
             SnapshotRef(identity="v-next", type=SnapshotType.INCREMENTAL)]
    inp = ApplySnapshotInput(hot_load_id="hl-t", identity="v-next", chain=chain, bucket="", path_prefix="")
    base_sums = checkpoint_checksums(base)
    before = await answer(engine)

    staged = await runtime.stage_update(inp, {"v-next": delta})
    assert staged.names and staged.arena_offsets, "the delta was not staged through the arena"
    victim = staged.names[0]
    flipped = runtime.arena.view(staged.arena_offsets[victim], 1)
    flipped[0] ^= 1  # after the decode checked it: only the read-back inside the pause can see it
    with pytest.raises(EngineUpdateError) as err:
        await runtime._swap_in(staged, ["v-base", "v-next"], PromptCachePolicy.PRESERVE)
    message = str(err.value)
    assert victim in message and "it serves its previous weights (v-base" in message, message
    assert runtime.applied == ["v-base"]
    assert await engine.weight_version() == "v-base"
    assert await engine.served_checksums() == base_sums
    await runtime.settled()
    assert host.checksums() == base_sums
    assert await answer(engine) == before

    flipped[0] ^= 1
    staged = await runtime.stage_update(inp, {"v-next": delta})
    _, _, verified = await runtime._swap_in(staged, ["v-base", "v-next"], PromptCachePolicy.PRESERVE)
    await runtime.settled()
    assert verified == len(staged.names)
    assert runtime.applied == ["v-base", "v-next"]
    assert await engine.weight_version() == "v-next"
    assert await engine.served_checksums() == checkpoint_checksums(counting)
    assert host.checksums() == checkpoint_checksums(counting)
    assert await answer(engine) != before
