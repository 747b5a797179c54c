"""The broadcast walk on the real Temporal dev server with test replicas: after the first replica
(from the bucket), every receiver stages at once and commits as soon as its own stage is ready,
in walk order, one at a time; a receiver whose stage fails reads the bucket instead."""

from __future__ import annotations

import asyncio

from tests.workflows.harness import ZONE, Fleet
from tests.workflows.test_admission import _state


async def test_receivers_commit_as_their_stages_finish_and_a_failed_stage_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        state = _state("walk", zones=[ZONE])
        state.replicas = f.replica_endpoints("walk", 4)
        dep = await f.deployment_from_state(state)
        slow_done = asyncio.Event()

        async def slow(replica: str) -> None:
            await asyncio.sleep(1.5)
            slow_done.set()

        async def broken(replica: str) -> None:
            raise RuntimeError("gloo: connection reset")

        f.stage_behaviour = {"replica-2": slow, "replica-3": broken}
        hl = await f.completed(dep, "step-1", hotLoadId="walk-1")
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        replicas = {r["name"]: r for r in (await f.call("GET", "/hotLoads/walk-1/replicas")).json()["replicas"]}
        assert [replicas[f"replica-{i}"]["source"] for i in range(4)] == [
            "bucket", "peer:replica-0", "peer:replica-0", "bucket"
        ]
        assert all(r["state"] == "READY" for r in replicas.values()), replicas
        # One replica at a time, in walk order: replica-1 committed while replica-2 still staged.
        commits = [name for name, event in f.peer_events if event == "commit"]
        assert commits == ["replica-1", "replica-2"]
        assert f.peer_events.index(("replica-1", "commit")) < f.peer_events.index(("replica-2", "staged"))
        assert [name for name, _ in f.applied] == ["replica-0", "replica-1", "replica-2", "replica-3"]
