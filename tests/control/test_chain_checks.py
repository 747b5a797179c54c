"""Admission's snapshot checks on a growing chain, on the real Temporal dev server with test
replicas (tests/helpers/harness.py; the real check against a local directory standing in for the
bucket): each snapshot is checked when it joins the chain, a delta on top of what every replica
serves is one check however long the chain, and an earlier link that a replica will read is
checked again against the fingerprint it had when it joined (removed or rewritten: refused).
The checks are counted in the deployment workflow's history, each with the identity it checked."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

from contracts import names
from contracts.records import SnapshotRef, SnapshotType
from snapshots.chain import MAX_CHAIN_DELTAS
from tests.helpers.harness import ZONE, Fleet, poll, write_delta
from tests.helpers.workflow_checks import delta_body, deployment_state, error

SHARD = "model-00001-of-00001.safetensors"


@dataclass
class Admission:
    """One `create_hot_load` the deployment handled: the snapshots it checked, in order."""

    checked: list[str] = field(default_factory=list)
    admitted: bool = False


async def admissions(f: Fleet, dep: str) -> list[Admission]:
    """Every `create_hot_load` the deployment's history shows, with the identity of each
    `check_snapshot_files` it scheduled (from the activity's input) and whether it started the
    hot-load."""
    seen: list[Admission] = []
    async for event in f.deployment_handle(dep).fetch_history_events():
        if event.HasField("workflow_execution_update_accepted_event_attributes"):
            request = event.workflow_execution_update_accepted_event_attributes.accepted_request
            if request.input.name == "create_hot_load":
                seen.append(Admission())
        elif event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == names.CHECK_SNAPSHOT:
                assert seen, "a snapshot check outside an admission"
                seen[-1].checked.append(json.loads(attrs.input.payloads[0].data)["identity"])
        elif event.HasField("start_child_workflow_execution_initiated_event_attributes"):
            seen[-1].admitted = True
    return seen


async def test_a_delta_on_what_every_replica_serves_is_one_check_however_long_the_chain(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        await f.completed(dep, "s0", hotLoadId=f"{dep}-s0")
        for i in range(1, 9):
            await f.completed(dep, f"s{i}", hotLoadId=f"{dep}-s{i}", **delta_body(f"s{i - 1}"))
        seen = await admissions(f, dep)
        # Chain position 0 (the full base) to 8: each admission checked its own snapshot only (the
        # old code checked every link, position + 1 checks).
        assert [(a.checked, a.admitted) for a in seen] == [([f"s{i}"], True) for i in range(9)]
        assert len((await f.deployment_state(dep)).verified_snapshots) == 9


async def test_the_last_delta_a_chain_may_hold_is_one_check(temporal_env, tmp_path):
    """At the 63-delta limit, from a deployment state (as carried across continue-as-new) whose
    replicas serve the 62nd delta: one check, of the 63rd."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        links = [SnapshotRef(identity="d0", type=SnapshotType.FULL, hot_load_id="c0")] + [
            SnapshotRef(identity=f"d{i}", type=SnapshotType.INCREMENTAL, hot_load_id=f"c{i}")
            for i in range(1, MAX_CHAIN_DELTAS)
        ]
        state = deployment_state("dep-long", zones=[ZONE], chains={f"d{MAX_CHAIN_DELTAS - 1}": links})
        state.replicas = [
            r.model_copy(update={"current_snapshot_identity": f"d{MAX_CHAIN_DELTAS - 1}"})
            for r in f.replica_endpoints("dep-long", 2)
        ]
        dep = await f.deployment_from_state(state)
        # Only the new delta is in the bucket: a check of any earlier link would refuse it.
        write_delta(f.bucket_root / "ckpt/dep-long", "d63", "d62")
        r = await f.create_hot_load(dep, "d63", hotLoadId="c63", **delta_body("d62"))
        assert r.status_code == 200, r.text
        assert len(r.json()["hotLoad"]["spec"]["snapshotChain"]) == MAX_CHAIN_DELTAS + 1
        assert [(a.checked, a.admitted) for a in await admissions(f, dep)] == [(["d63"], True)]


async def test_an_earlier_link_removed_or_rewritten_is_refused_when_a_replica_reads_it(temporal_env, tmp_path):
    """A link every replica already applied is read by no one, so its loss does not stop the next
    delta; once a replica does not serve the chain (here: it reports ready on its base weights),
    the next admission checks every link it will read, against the fingerprint
    each had when it joined the chain: a removed file and a rewritten one are both refused."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        root = f.bucket_root / f"ckpt/{dep}"
        await f.completed(dep, "s1", hotLoadId=f"{dep}-s1")
        await f.completed(dep, "s2", hotLoadId=f"{dep}-s2", **delta_body("s1"))
        away = tmp_path / "away"
        away.mkdir()
        (root / "s1" / SHARD).rename(away / SHARD)  # a rename keeps the file's version (mtime)
        await f.completed(dep, "s3", hotLoadId=f"{dep}-s3", **delta_body("s2"))

        async def noted() -> bool | None:
            state = await f.deployment_state(dep)
            return (
                True
                if state.active_hot_load_id is None and all(r.current_snapshot_identity == "s3" for r in state.replicas)
                else None
            )

        # The deployment takes note of a hot-load's end in its own next workflow task: a ready
        # signal before that would be overwritten by the note (s3), not kept.
        await poll(noted, 60, "the deployment took note of s3's end")
        # A replica that no longer serves the chain: it reports ready on the base weights.
        replica = (await f.deployment_state(dep)).members[-1]
        await f.signal_ready(dep, replica)

        async def forgotten() -> bool | None:
            state = await f.deployment_state(dep)
            return (
                True
                if [r.current_snapshot_identity for r in state.replicas if r.name == replica] == ["initial"]
                else None
            )

        await poll(forgotten, 30, f"{replica} on its base weights")
        write_delta(root, "s4", "s3")
        error(
            await f.create_hot_load(dep, "s4", hotLoadId=f"{dep}-s4", **delta_body("s3")),
            412,
            "failed_precondition",
            "snapshot 's1'",
            "missing required files",
            SHARD,
        )
        # Back as it was: admitted. Rewritten (other bytes): refused as changed, although complete.
        (away / SHARD).rename(root / "s1" / SHARD)
        shutil.copy2(root / "s2" / SHARD, away / SHARD)
        (root / "s2" / SHARD).write_text("other bytes")
        error(
            await f.create_hot_load(dep, "s4", hotLoadId=f"{dep}-s4", **delta_body("s3")),
            412,
            "failed_precondition",
            "snapshot 's2'",
            "changed since it joined",
        )
        shutil.copy2(away / SHARD, root / "s2" / SHARD)  # copy2 keeps the mtime: the same version
        r = await f.create_hot_load(dep, "s4", hotLoadId=f"{dep}-s4", **delta_body("s3"))
        assert r.status_code == 200, r.text
        seen = await admissions(f, dep)
        assert [(a.checked, a.admitted) for a in seen] == [
            (["s1"], True),
            (["s2"], True),
            (["s3"], True),
            # The replica serving none of the chain reads all of it, base first.
            (["s1", "s2", "s3", "s4"], False),
            (["s1", "s2", "s3", "s4"], False),
            (["s1", "s2", "s3", "s4"], True),
        ]
