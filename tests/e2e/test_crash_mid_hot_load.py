"""Crashes in the middle of a real multi-replica delta hot-load (real Dynamo vLLM workers on CPU, real S3,
real Temporal dev server; tests/control/test_durability.py covers the same with test replicas).

While a delta hot-load walks the 3-replica deployment (held, by the fault point ``pause``, just
before the second replica's pause: the first is done, the walk is surely under way), kill -9 the
control worker, or the Temporal dev server (restarted on the same SQLite file), restart it, then
release the hold. The operation ends
COMPLETED, every replica is READY on the identity and serves exactly the trainer's weights, no
engine is left paused, and no engine restarted.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.replicas import (
    ROLLING_PREFIX,
    engines,
    fault,
    faults,
    hot_load,
    hot_load_replicas,
    paused,
    served_checksums,
    walk_order,
)
from tests.helpers.trainer import train_step
from workers.stack import Stack, upload_dir

pytestmark = pytest.mark.stack


def kill9(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # services are spawned as group leaders
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["worker", "temporal"])
def test_crash_mid_walk_then_restart_completes(stack, rolling, tmp_path, victim):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = f"crash-{victim}-000000"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(base, tmp_path / "new", seed=21 if victim == "worker" else 22)
    identity = f"crash-{victim}-000001"
    write_delta(base, new_dir, tmp_path / identity, version="1", base_version="0")
    upload_dir(s3, tmp_path / identity, stack.bucket, f"{ROLLING_PREFIX}/{identity}")
    pids = {r["name"]: r["enginePid"] for r in engines(stack, dep_id)}

    services = Stack(stack)
    pid = services.pid_file(victim).alive_pid()
    assert pid is not None
    body = {
        "deploymentId": dep_id,
        "identity": identity,
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {"previousSnapshotIdentity": full_id},
    }
    first, second = (r["name"] for r in walk_order(stack, dep_id)[:2])
    hold = fault("pause", second, "hold")
    with faults(stack, hold):
        hl_id = api.call("POST", "/hotLoads", json=body).json()["hotLoad"]["spec"]["id"]
        hold.wait_fired(stack, dep_id)
        state = api.call("GET", f"/hotLoads/{hl_id}").json()["hotLoad"]["status"]["state"]
        assert state == "HOT_LOAD_STATE_IN_PROGRESS", f"the walk was not under way when {victim} was killed: {state}"
        reps = {r["name"]: r["state"] for r in hot_load_replicas(api, hl_id)}
        assert (reps[first], reps[second]) == ("READY", "UPDATING"), reps  # mid-walk: one done, one held
        kill9(pid)
        time.sleep(3)  # the rest of the stack notices: the API answers 503 while Temporal is down
        if victim == "temporal":
            assert api.call("GET", f"/hotLoads/{hl_id}").status_code == 503
        services.pid_file(victim).remove()
        print(services.start(victim))
    # the hold is released (faults.json removed): the walk goes on under the restarted process
    hl = api.wait_hot_load(hl_id, timeout=900)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    reps = api.call("GET", f"/hotLoads/{hl_id}/replicas").json()["replicas"]
    assert [(r["state"], r["currentSnapshotIdentity"]) for r in reps] == [("READY", identity)] * 3, reps
    expected = checkpoint_checksums(new_dir)
    now = engines(stack, dep_id)
    for replica in now:
        assert not paused(replica), f"{replica['name']} was left paused"
        assert served_checksums(replica) == expected, f"{replica['name']} serves other weights"
    assert {r["name"]: r["enginePid"] for r in now} == pids
