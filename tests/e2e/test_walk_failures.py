"""The hot-load walk's failure branches on the shared 3-replica deployment (real Dynamo vLLM workers on CPU,
real S3, real Temporal), each failure injected in the replica that has it through the
fault points of ``replica/faults.py`` (``faults.json`` in the stack's home, removed at the end).

Every test starts its own chain (a FULL of the base model, then a delta of one training step)
and leaves every replica serving one whole snapshot, unpaused, after a hot-load that completed.

- A cancel while the second replica's commit is held: the operation ends CANCELED and its
  workflow is canceled; no engine is paused; each replica serves exactly the snapshot its entry
  names (the first the delta, the others the base), bytes and label.
- The third replica's stage from the broadcast fails: it reads the bucket instead, the operation
  COMPLETES, and every replica serves the trainer's weights; the second still took the broadcast.
- The first replica's swap fails inside its pause: the operation ends FAILED naming it, its
  workflow failed; it serves its previous weights and label, and the others never moved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.replicas import (
    ROLLING_PREFIX,
    complete,
    engine_label,
    fault,
    faults,
    hot_load,
    hot_load_replicas,
    hot_load_workflow_status,
    paused,
    served_checksums,
    start_hot_load,
    wait_replica_state,
    walk_order,
)
from tests.helpers.stack_fixtures import Api
from tests.helpers.trainer import train_step
from workers.stack import upload_dir

pytestmark = pytest.mark.stack


def base_then_delta(stack, api: Api, dep_id: str, tmp: Path, tag: str, seed: int) -> tuple[str, str, Path]:
    """Serve a FULL `<tag>-000000` (the base model) on every replica and upload the delta
    `<tag>-000001` (one training step) without loading it; returns both identities and the
    trained checkpoint."""
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id, delta_id = f"{tag}-000000", f"{tag}-000001"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    trained = train_step(base, tmp / "trained", seed=seed)
    write_delta(base, trained, tmp / delta_id, version=delta_id, base_version=full_id)
    upload_dir(s3, tmp / delta_id, stack.bucket, f"{ROLLING_PREFIX}/{delta_id}")
    return full_id, delta_id, trained


def answers(replica: dict) -> bool:
    """The engine serves a short greedy completion (a paused one would not: out of the routing pool)."""
    answer = complete(replica, {"prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    return answer["usage"]["completion_tokens"] == 4


def restore(stack, api: Api, dep_id: str, tag: str) -> None:
    """A FULL hot-load of the base model completes: every replica serves one whole snapshot."""
    identity = f"{tag}-restore"
    upload_dir(stack.s3_client(), stack.home_path / "models" / "base", stack.bucket, f"{ROLLING_PREFIX}/{identity}")
    hl = hot_load(api, dep_id, identity, None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    expected = checkpoint_checksums(stack.home_path / "models" / "base")
    for replica in walk_order(stack, dep_id):
        assert served_checksums(replica) == expected and engine_label(replica) == identity, replica["name"]


def test_a_cancel_mid_walk_leaves_each_replica_on_one_whole_snapshot(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    full_id, delta_id, trained = base_then_delta(stack, api, dep_id, tmp_path, "cancel", seed=31)
    order = walk_order(stack, dep_id)
    first, second = order[0]["name"], order[1]["name"]
    hold = fault("commit_peer_stage", second, "hold")
    hl_id = None
    try:
        with faults(stack, hold):
            hl_id = start_hot_load(api, dep_id, delta_id, full_id)
            wait_replica_state(api, hl_id, second, "UPDATING")
            hold.wait_fired(stack, dep_id)
            reps = {r["name"]: r for r in hot_load_replicas(api, hl_id)}
            assert reps[first]["state"] == "READY" and reps[second]["state"] == "UPDATING", reps
            r = api.call("POST", f"/hotLoads/{hl_id}:cancel")
            assert r.status_code == 200, r.text
            hl = api.wait_hot_load(hl_id, timeout=300)
    finally:
        if hl_id:
            api.wait_hot_load(hl_id)  # released by now: the next test finds no hot-load open
    assert hl["status"]["state"] == "HOT_LOAD_STATE_CANCELED", hl["status"]
    assert hot_load_workflow_status(stack, hl_id) == WorkflowExecutionStatus.CANCELED

    reps = {r["name"]: r for r in hot_load_replicas(api, hl_id)}
    assert reps[first]["state"] == "READY" and reps[first]["currentSnapshotIdentity"] == delta_id, reps[first]
    for name in (second, order[2]["name"]):
        assert reps[name]["state"] == "PENDING_UPDATE" and reps[name]["currentSnapshotIdentity"] == full_id, reps[name]
    expected = {
        full_id: checkpoint_checksums(stack.home_path / "models" / "base"),
        delta_id: checkpoint_checksums(trained),
    }
    for replica in walk_order(stack, dep_id):
        identity = reps[replica["name"]]["currentSnapshotIdentity"]
        assert not paused(replica), f"{replica['name']} was left paused"
        assert answers(replica), f"{replica['name']} does not serve"
        assert served_checksums(replica) == expected[identity], f"{replica['name']} serves a mix of weights"
        assert engine_label(replica) == identity

    restore(stack, api, dep_id, "cancel")


def test_a_receiver_whose_broadcast_stage_fails_reads_the_bucket(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    full_id, delta_id, trained = base_then_delta(stack, api, dep_id, tmp_path, "nostage", seed=32)
    order = [r["name"] for r in walk_order(stack, dep_id)]
    broken = fault("stage_from_peer", order[2], "fail")
    with faults(stack, broken):
        hl = hot_load(api, dep_id, delta_id, full_id)
        assert broken.fired(stack, dep_id), "the receiver never started its stage from the broadcast"
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    reps = hot_load_replicas(api, hl["spec"]["id"])
    assert [r["name"] for r in reps] == order
    assert [(r["state"], r["currentSnapshotIdentity"]) for r in reps] == [("READY", delta_id)] * 3, reps
    assert reps[0]["source"] == "bucket" and reps[0]["bytesReadFromBucket"] > 0, reps[0]
    assert reps[1]["source"].startswith("peer:") and reps[1]["bytesReadFromBucket"] == 0, reps[1]
    assert reps[2]["source"] == "bucket" and reps[2]["bytesReadFromBucket"] > 0, reps[2]
    expected = checkpoint_checksums(trained)
    for replica in walk_order(stack, dep_id):
        assert served_checksums(replica) == expected, f"{replica['name']} serves other weights"
        assert engine_label(replica) == delta_id


def test_the_first_replicas_failed_swap_leaves_every_replica_on_its_weights(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    full_id, delta_id, trained = base_then_delta(stack, api, dep_id, tmp_path, "badswap", seed=33)
    order = walk_order(stack, dep_id)
    first = order[0]["name"]
    before = {r["name"]: (served_checksums(r), engine_label(r)) for r in order}
    assert {label for _, label in before.values()} == {full_id}

    broken = fault("swap", first, "fail")
    with faults(stack, broken):
        hl = hot_load(api, dep_id, delta_id, full_id)
        assert broken.fired(stack, dep_id)
    hl_id = hl["spec"]["id"]
    assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
    failed = [c for c in hl["status"]["conditions"] if c["type"] == "Failed"]
    assert failed and first in failed[0]["message"], hl["status"]["conditions"]
    assert hot_load_workflow_status(stack, hl_id) == WorkflowExecutionStatus.FAILED
    reps = hot_load_replicas(api, hl_id)
    assert reps[0]["name"] == first and reps[0]["state"] == "ERROR", reps[0]
    assert first in reps[0]["errorReason"] and "swap" in reps[0]["errorReason"], reps[0]
    assert all(r["currentSnapshotIdentity"] == full_id for r in reps), reps
    assert [r["state"] for r in reps[1:]] == ["PENDING_UPDATE"] * 2, reps
    after = {r["name"]: (served_checksums(r), engine_label(r)) for r in walk_order(stack, dep_id)}
    assert after == before, "a failed swap changed what a replica serves or how it labels it"
    assert all(not paused(r) for r in walk_order(stack, dep_id))

    # The same update under a new identity then completes on every replica.
    again = "badswap-000002"
    write_delta(stack.home_path / "models" / "base", trained, tmp_path / again, version=again, base_version=full_id)
    upload_dir(stack.s3_client(), tmp_path / again, stack.bucket, f"{ROLLING_PREFIX}/{again}")
    hl = hot_load(api, dep_id, again, full_id)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    expected = checkpoint_checksums(trained)
    for replica in walk_order(stack, dep_id):
        assert served_checksums(replica) == expected and engine_label(replica) == again, replica["name"]
