"""The hot-load walk over SIMULATED replicas (replica/simulated/, `rollouts sim-node`) on the
session's real stack: the real API, control worker, deployment and hot-load workflows and S3;
no engine. The simulated node reports simulated GPUs and the deployment asks one per replica, so
placement puts every replica there and none on the stack's real CPU node: no vLLM starts.

The deployment stages in groups of GROUP (`hotLoad.replicasPerGroup`, child workflows), fans out
FAN_OUT receivers at a time and swaps K replicas at once.

- A FULL and a delta hot-load of a 40-replica deployment end COMPLETED with every replica READY
  on the new identity; the first replica read the bucket, every other one staged from a peer, in
  at most ROUNDS fan-out rounds; the hot-load's history stays within EVENTS_PER_REPLICA events per
  replica and the stage groups are child workflows that each hold only their own group's stages.
- A receiver whose stage from a peer fails (fault point `stage_from_peer`, in the middle of the
  tree) reads the bucket instead and passes nothing on; every other replica still staged from a
  peer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from temporalio.service import RPCError

from common.processes import stop_pid
from common.settings import temporal_client
from contracts import names
from snapshots.synthetic import make_checkpoint_pair
from snapshots.writer import write_delta
from tests.helpers.deployments import delete_deployment
from tests.helpers.replicas import fault, faults, hot_load, hot_load_replicas
from tests.helpers.stack_fixtures import Api, wait_registered
from workers.stack import upload_dir

pytestmark = pytest.mark.stack

REPLICAS = 40
GROUP, FAN_OUT, K = 8, 2, 4
# 39 receivers: the leaders (5 groups) in 2 rounds, then up to 7 more members in 2 more.
ROUNDS = 4
# The commit and its two replica-entry changes (~8 events per replica), and the group leaders'
# stages; measured: bench/README.md.
EVENTS_PER_REPLICA = 10
PREFIX = "sim/ckpt"


@pytest.fixture(scope="module")
def simulated(stack, tmp_path_factory):
    """A simulated node with REPLICAS simulated GPUs, and a deployment of REPLICAS on it."""
    log = tmp_path_factory.mktemp("sim") / "sim-node.log"
    with log.open("wb") as out:
        node = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "sim-node", "--home", str(stack.home_path), "--name", "sim-test",
             "--gpus", str(REPLICAS), "--transfer-ms", "20"],
            stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
            start_new_session=True,  # its own process group: stop_pid signals the group
        )
    api = Api(stack)
    dep_id = None
    try:
        wait_registered(stack, "sim-test")
        body = {
            "name": "simulated", "gatewayIds": [stack.gateway_id],
            "resources": {"instanceType": "cpu-local", "gpuCount": 1},
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
            "model": {"name": "sim-model", "bucket": stack.bucket, "path": stack.base_model_path},
            "autoscaling": {"min": REPLICAS, "max": REPLICAS},
            "hotLoad": {"bucket": stack.bucket, "pathPrefix": PREFIX, "replicasPerGroup": GROUP,
                        "peerFanOut": FAN_OUT, "maxConcurrentSwaps": K},
        }
        r = api.call("POST", "/deployments", json=body)
        assert r.status_code == 200, r.text
        dep_id = r.json()["deployment"]["spec"]["id"]
        dep = api.wait_deployment(dep_id, timeout=300)
        assert dep["status"]["status"] == "STATUS_READY", dep["status"]
        work = tmp_path_factory.mktemp("sim-ckpt")
        make_checkpoint_pair(work / "base", work / "new", size_mb=1, seed=0)
        s3 = stack.s3_client()
        for full, delta in (("sim-0", "sim-1"), ("sim-2", "sim-3")):
            write_delta(work / "base", work / "new", work / delta, version=delta, base_version=full)
            upload_dir(s3, work / "base", stack.bucket, f"{PREFIX}/{full}")
            upload_dir(s3, work / delta, stack.bucket, f"{PREFIX}/{delta}")
        yield api, dep_id
    finally:
        if dep_id is not None:
            delete_deployment(api, dep_id)
        stop_pid(node.pid, timeout=30)


def all_replicas(api: Api, hl_id: str) -> list[dict]:
    replicas = hot_load_replicas(api, hl_id)
    assert len(replicas) == REPLICAS
    return replicas


def histories(stack, hot_load_id: str) -> tuple[int, list[int]]:
    """History events of the hot-load's workflow and of each of its stage groups."""

    async def read() -> tuple[int, list[int]]:
        client = await temporal_client(stack)
        workflow_id = names.hot_load_workflow_id(stack.organization_id, hot_load_id)
        events = (await client.get_workflow_handle(workflow_id).describe()).raw_description
        groups = []
        while True:
            try:
                child = await client.get_workflow_handle(names.stage_group_workflow_id(workflow_id, len(groups))).describe()
            except RPCError:
                return events.workflow_execution_info.history_length, groups
            groups.append(child.raw_description.workflow_execution_info.history_length)

    return asyncio.run(read())


def test_a_simulated_deployment_hot_loads_full_then_delta(stack, simulated):
    api, dep_id = simulated
    for identity, previous in (("sim-0", None), ("sim-1", "sim-0")):
        started = time.monotonic()
        hl = hot_load(api, dep_id, identity, previous)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        replicas = all_replicas(api, hl["spec"]["id"])
        assert {r["state"] for r in replicas} == {"READY"}
        assert {r["currentSnapshotIdentity"] for r in replicas} == {identity}
        first, *rest = replicas
        assert first["source"] == "bucket" and first["bytesReadFromBucket"] > 0
        assert all(r["source"].startswith("peer:") and r["bytesReadFromBucket"] == 0 for r in rest), rest
        assert 1 < max(r["peerRound"] for r in rest) <= ROUNDS, [r["peerRound"] for r in rest]
        senders = [r["source"] for r in rest]
        assert max(senders.count(s) for s in set(senders)) <= FAN_OUT * ROUNDS
        events, groups = histories(stack, hl["spec"]["id"])
        assert events <= EVENTS_PER_REPLICA * REPLICAS, events
        assert len(groups) == -(-(REPLICAS - 1) // GROUP)  # one child workflow per group of receivers
        assert all(g <= EVENTS_PER_REPLICA * GROUP for g in groups), groups
        print(f"{identity}: {REPLICAS} simulated replicas in {time.monotonic() - started:.1f} s; history {events} "
              f"events, stage groups {groups}")


def test_a_receiver_failing_mid_walk_reads_the_bucket_and_the_rest_stage_from_peers(stack, simulated):
    api, dep_id = simulated
    hl = hot_load(api, dep_id, "sim-2", None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    names = [r["name"] for r in all_replicas(api, hl["spec"]["id"])]
    broken = names[REPLICAS // 2]
    with faults(stack, fault("stage_from_peer", broken, "fail")):
        hl = hot_load(api, dep_id, "sim-3", "sim-2")
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    by_name = {r["name"]: r for r in all_replicas(api, hl["spec"]["id"])}
    assert by_name[broken]["source"] == "bucket" and by_name[broken]["bytesReadFromBucket"] > 0
    others = [r for n, r in by_name.items() if n not in (broken, names[0])]
    assert all(r["source"].startswith("peer:") for r in others), [r["source"] for r in others]
    assert {r["currentSnapshotIdentity"] for r in by_name.values()} == {"sim-3"}
