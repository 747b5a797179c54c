"""A deployment's status tells the truth across a configuration update and a restart, on the real
stack with a real Dynamo vLLM worker on CPU (one, to keep the cost at three engine starts).

- Created while S3 fails the replica's model read twice (the error SeaweedFS gives botocore when
  it cannot read a chunk, injected at the `model_download` fault point): the replica's start
  tries again with backoff, the deployment says why meanwhile (`ReplicaStartRetrying`, naming
  the error), and it is READY once the read succeeds.

- `PATCH` of `runtime.engineConfig` rolls the replica onto it: the deployment leaves READY
  (a hot-load and another update are refused meanwhile), keeps a replica serving throughout,
  and is READY again on a new engine whose command line carries the new flag and which caught
  up to the deployment's current snapshot before it served.
- A delta hot-load, then replica processes stopped as `rollouts down` stops them (the control
  worker first, then the replicas): the stopped agent withdrew the record that offered its
  decode of the delta to the host's other replicas (it existed before the stop). The worker
  started again as `rollouts up` does: the deployment reads
  STATUS_UPDATING, not the READY it last recorded, and refuses a hot-load with
  failed_precondition until its replica serves again (caught up through the delta), then admits one.
- A whole `rollouts down` then `rollouts up` (a stack of its own; Temporal's data survives):
  from the moment the API answers again, every read says STATUS_UPDATING until the replica
  serves, then READY; a hot-load asked for right after `up` is refused.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.processes import stop_pid
from replica.agent.host_decodes import arena_pid, read_records
from replica.stage_arena import shm_dir
from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.ready import first_requests_served
from tests.helpers.replicas import engines, fault, faults, hot_load, served_checksums
from tests.helpers.stack_fixtures import Api, deployment_body, start_stack
from tests.helpers.trainer import train_step
from workers.stack import Stack, upload_dir

pytestmark = pytest.mark.stack

PREFIX = "checkpoints/lifecycle"
TRAINED = "life-000001"
DELTA = "life-000002"


def _wait_ready_noting_conditions(api: Api, dep_id: str, timeout: float = 900) -> tuple[dict, list[tuple[str, str]]]:
    """Poll until READY or FAILED; every (reason, message) of a condition seen on the way."""
    said: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while True:
        dep = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]
        for c in dep["status"].get("conditions", []):
            if (c.get("reason"), c.get("message")) not in said:
                said.append((c.get("reason"), c.get("message")))
        if dep["status"]["status"] in ("STATUS_READY", "STATUS_FAILED"):
            return dep, said
        assert time.monotonic() < deadline, f"deployment {dep_id} not ready after {timeout:.0f}s: {said}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def lifecycle(stack, tmp_path_factory):
    """A 1-replica deployment serving TRAINED (a FULL hot-load of weights that differ from the
    base), those weights' checksums, and their directory."""
    api = Api(stack)
    body = deployment_body(stack, "lifecycle", replicas=1, path_prefix=PREFIX)
    # The replica's first two reads of its model fail as a flaky S3 server fails them.
    with faults(stack, fault("model_download", "*", "s3_error"), fault("model_download", "*", "s3_error")):
        dep = api.call("POST", "/deployments", json=body).json()["deployment"]
        dep, said = _wait_ready_noting_conditions(api, dep["spec"]["id"])
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    retrying = [m for reason, m in said if reason == "ReplicaStartRetrying"]
    assert retrying and "InternalError" in retrying[0] and "model" in retrying[0], said
    first_requests_served(stack, dep["spec"]["id"])
    trained = train_step(stack.home_path / "models" / "base", tmp_path_factory.mktemp("trained") / TRAINED, seed=41)
    upload_dir(stack.s3_client(), trained, stack.bucket, f"{PREFIX}/{TRAINED}")
    assert hot_load(api, dep["spec"]["id"], TRAINED, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    yield api, dep, body, checkpoint_checksums(trained), trained
    api.call("DELETE", f"/deployments/{dep['spec']['id']}")


def flag(pid: int, name: str) -> str | None:
    """The value of `--name` on process `pid`'s command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index(name) + 1] if name in argv else None


def publish_base(stack, identity: str) -> None:
    """The base model as a FULL snapshot named `identity` (its content does not matter here)."""
    upload_dir(stack.s3_client(), stack.home_path / "models" / "base", stack.bucket, f"{PREFIX}/{identity}")


def answers(stack, model: str) -> None:
    r = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        headers={"Authorization": f"Bearer {stack.admin_token}"},
        json={"model": model, "prompt": [5, 100, 200], "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


def test_engine_config_update_rolls_the_replica_onto_it(stack, lifecycle):
    api, dep, body, expected, _ = lifecycle
    dep_id = dep["spec"]["id"]
    (old,) = engines(stack, dep_id)
    assert flag(old["enginePid"], "--max-num-seqs") == "32"
    old_dir = Path(psutil.Process(old["enginePid"]).cwd())  # its work directory (TMPDIR, caches)
    assert (old_dir / "tmp").is_dir()

    patch = {"hotLoad": body["hotLoad"], "runtime": {**body["runtime"], "engineConfig": {"max-num-seqs": "6"}}}
    r = api.call("PATCH", f"/deployments/{dep_id}", json=patch)
    assert r.status_code == 200, r.text
    assert r.json()["deployment"]["spec"]["runtime"]["engineConfig"] == {"max-num-seqs": "6"}
    status = r.json()["deployment"]["status"]
    assert status["status"] == "STATUS_UPDATING" and status["conditions"][0]["reason"] == "RollingUpdate", status

    # While it rolls: no hot-load, no other update.
    publish_base(stack, "life-roll")
    r = api.call(
        "POST", "/hotLoads", json={"deploymentId": dep_id, "identity": "life-roll", "type": "SNAPSHOT_TYPE_FULL"}
    )
    assert r.status_code == 412 and r.json()["code"] == "failed_precondition", r.text
    assert "STATUS_UPDATING, not STATUS_READY" in r.json()["message"], r.text
    r = api.call("PATCH", f"/deployments/{dep_id}", json=patch)
    assert r.status_code == 412 and "STATUS_UPDATING" in r.json()["message"], r.text

    # Every status read until READY again: UPDATING, with the old replica serving throughout.
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        st = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]["status"]
        seen.append((st["status"], st["readyReplicas"]))
        if st["status"] != "STATUS_UPDATING":
            break
        time.sleep(0.5)
    assert seen[-1] == ("STATUS_READY", 1), seen
    assert all(s == ("STATUS_UPDATING", 1) or s == ("STATUS_UPDATING", 2) for s in seen[:-1]), seen

    (new,) = engines(stack, dep_id)
    assert new["name"] != old["name"]
    assert flag(new["enginePid"], "--max-num-seqs") == "6"
    assert not Path(f"/proc/{old['enginePid']}").exists(), "the replaced engine still runs"
    assert not old_dir.exists(), f"the replaced engine's work directory {old_dir} was left behind"
    # It caught up to the deployment's snapshot before it served.
    assert new["currentSnapshotIdentity"] == TRAINED
    assert served_checksums(new) == expected
    answers(stack, body["model"]["name"])


def decode_records_of(agent_pid: int) -> list[Path]:
    """This host's decode records whose arena is in process `agent_pid`."""
    return [path for path, record in read_records(shm_dir()) if arena_pid(record) == agent_pid]


def test_replicas_stopped_by_down_are_not_ready_and_refuse_hot_loads(stack, lifecycle, tmp_path):
    api, dep, body, trained_checksums, trained = lifecycle
    dep_id = dep["spec"]["id"]
    dep = api.wait_deployment(dep_id)
    assert dep["status"]["status"] == "STATUS_READY"
    # A delta on top: the replica decodes it and offers the decode to the host's replicas.
    new = train_step(trained, tmp_path / "new", seed=42)
    assert write_delta(trained, new, tmp_path / DELTA, version=DELTA, base_version=TRAINED).changed > 0
    upload_dir(stack.s3_client(), tmp_path / DELTA, stack.bucket, f"{PREFIX}/{DELTA}")
    assert hot_load(api, dep_id, DELTA, TRAINED)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    expected = checkpoint_checksums(new)
    assert expected != trained_checksums
    (before,) = engines(stack, dep_id)
    assert decode_records_of(before["agentPid"]), "the replica offered no decode of the delta"
    max_num_seqs = dep["spec"]["runtime"].get("engineConfig", {}).get("max-num-seqs", "32")
    publish_base(stack, "life-restart")
    services = Stack(stack)

    # `rollouts down`: the control worker first, then the replicas (agents, then engines).
    worker = services.pid_file("worker")
    stop_pid(worker.alive_pid(), timeout=20)
    worker.remove()
    stopped = 0
    for pf in services.replica_pid_files():
        if pf.path.parent.parent.name == dep_id:
            pid = pf.alive_pid()
            if pid:
                stop_pid(pid, timeout=20)
                stopped += 1
            pf.remove()
    assert stopped >= 1
    assert not decode_records_of(before["agentPid"]), "the stopped agent left its decode record"
    # `rollouts up`: the worker reports ready once every deployment checked its replicas.
    print(services.start("worker", timeout=240))

    st = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]["status"]
    assert st["status"] == "STATUS_UPDATING" and st["readyReplicas"] == 0, st
    assert st["conditions"][0]["reason"] == "ReplicasRestarting", st
    r = api.call(
        "POST", "/hotLoads", json={"deploymentId": dep_id, "identity": "life-restart", "type": "SNAPSHOT_TYPE_FULL"}
    )
    assert r.status_code == 412 and r.json()["code"] == "failed_precondition", r.text
    assert "STATUS_UPDATING, not STATUS_READY" in r.json()["message"], r.text

    dep = api.wait_deployment(dep_id)
    assert dep["status"]["status"] == "STATUS_READY" and dep["status"]["readyReplicas"] == 1, dep["status"]
    (after,) = engines(stack, dep_id)
    assert after["name"] == before["name"] and after["enginePid"] != before["enginePid"]
    # Restarted on the deployment's runtime, caught up to its snapshot.
    assert flag(after["enginePid"], "--max-num-seqs") == max_num_seqs
    assert after["currentSnapshotIdentity"] == DELTA and served_checksums(after) == expected
    hl = hot_load(api, dep_id, "life-restart", None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    answers(stack, body["model"]["name"])


def test_down_then_up_reads_updating_until_the_replica_serves(tmp_path_factory):
    services, settings = start_stack(tmp_path_factory.mktemp("down-up-home"))
    try:
        api = Api(settings)
        body = deployment_body(settings, "downup", replicas=1, path_prefix="checkpoints/downup")
        dep_id = api.call("POST", "/deployments", json=body).json()["deployment"]["spec"]["id"]
        assert api.wait_deployment(dep_id)["status"]["status"] == "STATUS_READY"
        services.down(say=print)

        # Every status the API answers from the moment it is back, until READY.
        seen: list[tuple[str, int]] = []
        done = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and not done.is_set():
                try:
                    st = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]["status"]
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.1)  # the API is not up yet
                    continue
                seen.append((st["status"], st["readyReplicas"]))
                if st["status"] == "STATUS_READY":
                    return
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        services.up(say=print)
        upload_dir(
            settings.s3_client(), settings.home_path / "models" / "base", settings.bucket, "checkpoints/downup/after-up"
        )
        body_hl = {"deploymentId": dep_id, "identity": "after-up", "type": "SNAPSHOT_TYPE_FULL"}
        r = api.call("POST", "/hotLoads", json=body_hl)
        assert r.status_code == 412 and r.json()["code"] == "failed_precondition", r.text
        assert (
            "STATUS_UPDATING, not STATUS_READY" in r.json()["message"] and "ReplicasRestarting" in r.json()["message"]
        )
        watcher.join(900)
        done.set()
        assert seen and seen[-1] == ("STATUS_READY", 1), seen
        assert all(s == ("STATUS_UPDATING", 0) for s in seen[:-1]), seen
        assert len(seen) > 1, seen  # it was read while the replica restarted
        hl = hot_load(api, dep_id, "after-up", None)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    finally:
        services.down(say=print)
