"""The service across real hosts: three network-namespace hosts (tests/multihost/hosts.py), the
control plane (`rollouts up --host`, with its own node agent) in the first, a node agent
(`rollouts node`) in each of the others, real Dynamo vLLM workers (sharing the control host's
Dynamo discovery directory), driven by cwtrain's CLI and the REST API from outside the hosts. One module, one
deployment, in order:

1. A 3-replica deployment lands on three hosts; a FULL and three deltas reach every replica, the
   first from the bucket and the others from it across hosts (0 bytes from the bucket); every
   replica serves exactly the trainer's weights (read on its own host); the gateway answers.
2. From one host, another host's worker does not answer its control routes (its control server
   is on its own loopback), and answers inference through Dynamo's frontend.
3. A partition: a replica host's link is down ~20 s while the broadcast runs; the operation ends
   in a documented state, no replica serves a mix, and the deployment converges without a manual
   step (READY; a FAILED operation's snapshot reaches every replica when the trainer loads it
   again).
4. A host dies mid-walk (kill -9 of everything in it): the operation FAILS naming the replica, no
   replica serves a mix, the lost replica is placed on a surviving host and catches up, the
   deployment is READY, and the next hot-load COMPLETES.

Each test prints what the operation and the replicas ended as (and hot-load times across hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from common.dynamo_planes import request_annotation
from common.settings import Settings, temporal_client
from contracts.names import hot_load_workflow_id
from replica.engine.dynamo_card import FILES_DIR
from replica.faults import FAULTS_FILE
from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.ready import first_requests_served
from tests.helpers.replicas import engines, hot_load, hot_load_body, hot_load_replicas, walk_order
from tests.helpers.stack_fixtures import Api, cwtrain, deployment_body, json_out, require_cwtrain
from tests.helpers.trainer import train_step
from tests.multihost.hosts import Cluster, Host
from tests.multihost.plane import (
    LOCAL_NODE,
    REPO,
    node_home,
    registry_nodes,
    stack_home,
    start_control_plane,
    start_node,
    stop_control_plane,
    wait_nodes,
)
from workers.stack import upload_dir

pytestmark = [pytest.mark.stack, pytest.mark.engine]

PREFIX = "checkpoints/multihost"
PARTITION_S = 20.0


@dataclass
class Plane:
    """The control plane's settings (as a trainer outside the hosts sees them) and the hosts."""

    settings: Settings
    hosts: dict[str, Host]  # node name -> host
    homes: dict[str, Path]  # node name -> that node agent's home (replica dirs, faults.json)
    dep_id: str = ""
    chain: list[tuple[str, Path]] = field(default_factory=list)  # (identity, full checkpoint dir)
    timings: list[tuple[str, float]] = field(default_factory=list)

    @property
    def api(self) -> Api:
        return Api(self.settings)

    def replicas(self) -> list[dict]:
        return engines(self.settings, self.dep_id)

    def host_of(self, replica: dict) -> Host:
        return self.hosts[replica["node"]]


def wait_for(check, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(every)


@pytest.fixture(scope="module")
def plane(cluster: Cluster):
    require_cwtrain()
    ctl, *others = list(cluster)
    settings = start_control_plane(ctl, node_slots=2)
    hosts, homes = {LOCAL_NODE: ctl}, {LOCAL_NODE: stack_home(ctl)}
    try:
        for host in others:
            start_node(host, settings, slots=2)
            hosts[host.name], homes[host.name] = host, node_home(host)
        wait_nodes(settings, list(hosts))
        yield Plane(settings=settings, hosts=hosts, homes=homes)
    finally:
        stop_control_plane(ctl)


@pytest.fixture(scope="module")
def deployment(plane: Plane, tmp_path_factory) -> Plane:
    body = deployment_body(plane.settings, "multihost", replicas=3, path_prefix=PREFIX)
    path = tmp_path_factory.mktemp("req") / "deployment.json"
    path.write_text(json.dumps(body))
    t0 = time.monotonic()
    out = json_out(cwtrain(plane.settings, "deployment", "create", "--file", str(path), "--wait", "--timeout", "1200"))
    print(f"3 replicas on 3 hosts ready in {time.monotonic() - t0:.1f}s")
    first_requests_served(plane.settings, out["id"])
    plane.dep_id = out["id"]
    return plane


def served(plane: Plane, replica: dict) -> tuple[dict[str, str], str | None]:
    """The replica's served checksums and weight label, read on its own host over loopback."""
    host = plane.host_of(replica)
    port = replica["engineUrl"].rsplit(":", 1)[1]
    kind = "dynamo" if replica.get("dynamoWorker") else "vllm"
    r = host.run(
        [sys.executable, "-m", "tests.multihost.engine_probe", port, replica["engineSecret"], kind],
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, f"probe of {replica['name']} on {host.name}: {r.stderr}"
    checksums, label = json.loads(r.stdout)
    return checksums, label


def probe_call(
    source: Host, method: str, url: str, secret: str, body: dict | None = None, tls: Path | None = None
) -> tuple[int, str]:
    extra = ([json.dumps(body)] if body is not None else []) + ([f"--tls={tls}"] if tls else [])
    r = source.run(
        [sys.executable, "-m", "tests.multihost.http_probe", method, url, secret, *extra], timeout=60, cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    status, text = json.loads(r.stdout)
    return status, text


def next_delta(plane: Plane, tmp: Path, step: int) -> tuple[str, str, Path]:
    """Train a step on the last checkpoint, write and upload its delta: (identity, previous, dir)."""
    prev_id, prev_dir = plane.chain[-1]
    identity = f"mh-{step:06d}"
    new_dir = train_step(prev_dir, tmp / f"full-{step}", seed=step)
    stats = write_delta(prev_dir, new_dir, tmp / identity, version=identity, base_version=prev_id)
    assert stats.changed > 0
    upload_dir(plane.settings.s3_client(), tmp / identity, plane.settings.bucket, f"{PREFIX}/{identity}")
    plane.chain.append((identity, new_dir))
    return identity, prev_id, new_dir


def checkpoint_of(plane: Plane, identity: str) -> Path:
    return dict(plane.chain)[identity]


def assert_no_mix(plane: Plane) -> dict[str, str]:
    """Every replica serves exactly the checkpoint its entry names, label included; returns
    replica name -> identity."""
    out = {}
    for replica in plane.replicas():
        identity = replica["currentSnapshotIdentity"]
        checksums, label = served(plane, replica)
        assert checksums == checkpoint_checksums(checkpoint_of(plane, identity)), (
            f"{replica['name']} on {replica['node']} does not serve exactly {identity}"
        )
        assert label == identity, (replica["name"], label, identity)
        out[replica["name"]] = identity
    return out


@contextlib.contextmanager
def first_step_held(plane: Plane, first: dict) -> Iterator[Callable[[], None]]:
    """Hold the first replica's step at its start (a fault point on its host); yields a function
    that waits until the hold fired. Leaving the block releases it."""
    rule_id = f"hold-{uuid.uuid4().hex[:8]}"
    home = plane.homes[first["node"]]
    faults = home / FAULTS_FILE
    faults.write_text(
        json.dumps(
            {
                "rules": [
                    {"id": rule_id, "point": "apply_snapshot", "replica": first["name"], "action": "hold", "times": 1}
                ]
            }
        )
    )
    log = home / "replicas" / plane.dep_id / first["name"] / "replica.log"
    try:
        yield lambda: wait_for(
            lambda: log.exists() and f"fault {rule_id} fires" in log.read_text(),
            300,
            f"the hold on {first['name']} fired",
        )
    finally:
        faults.unlink(missing_ok=True)


def admit(plane: Plane, identity: str, previous: str | None) -> str:
    """POST the hot-load; a documented transient refusal (`unavailable`: a node agent did not
    answer the admission's check of its replicas, e.g. right after a partition healed) is
    printed and asked again, for at most 3 minutes. Returns the hot-load id."""
    deadline = time.monotonic() + 180
    while True:
        r = plane.api.call("POST", "/hotLoads", json=hot_load_body(plane.dep_id, identity, previous))
        if r.status_code == 200:
            return r.json()["hotLoad"]["spec"]["id"]
        assert r.json().get("code") == "unavailable" and time.monotonic() < deadline, (r.status_code, r.text)
        print(f"admission of {identity} refused for now: {r.json().get('message')}")
        time.sleep(2)


def seconds(hl: dict) -> float:
    st = hl["status"]
    parse = lambda ts: datetime.fromisoformat(ts.replace("Z", "+00:00"))  # noqa: E731
    return (parse(st["finishedAt"]) - parse(st["createdAt"])).total_seconds()


def activity_times(settings: Settings, hl_id: str, activity_type: str) -> list[float]:
    """Epoch seconds at which the hot-load workflow scheduled each `activity_type` activity."""

    async def read() -> list[float]:
        client = await temporal_client(settings)
        handle = client.get_workflow_handle(hot_load_workflow_id(settings.organization_id, hl_id))
        out = []
        async for event in handle.fetch_history_events():
            attrs = event.activity_task_scheduled_event_attributes
            if event.HasField("activity_task_scheduled_event_attributes") and attrs.activity_type.name == activity_type:
                out.append(event.event_time.ToDatetime().timestamp())
        return out

    return asyncio.run(read())


def wait_ready(plane: Plane, timeout: float = 900) -> dict:
    def ready() -> dict | None:
        dep = plane.api.call("GET", f"/deployments/{plane.dep_id}").json()["deployment"]
        return dep if dep["status"]["status"] == "STATUS_READY" else None

    return wait_for(ready, timeout, f"deployment {plane.dep_id} READY", every=2)


# ------------------------------------------------------------------------------------ 1
def test_three_hosts_full_then_three_deltas_cross_hosts(deployment: Plane, tmp_path: Path) -> None:
    plane = deployment
    replicas = plane.replicas()
    nodes = [r["node"] for r in replicas]
    assert len(set(nodes)) == 3 and set(nodes) == set(plane.hosts), f"not spread over the 3 hosts: {nodes}"
    for r in replicas:
        # A Dynamo worker's engine URL is its control server, on its own host's loopback only.
        assert r["dynamoWorker"] and r["engineUrl"].startswith("http://127.0.0.1:"), r

    # FULL: a trained step, published with cwtrain.
    base = plane.settings.home_path / "models" / "base"
    full_dir = train_step(base, tmp_path / "full-0", seed=1000)
    published = json_out(
        cwtrain(
            plane.settings,
            "hotload",
            "publish",
            "--deployment",
            plane.dep_id,
            "--checkpoint",
            str(full_dir),
            "--identity",
            "mh-000000",
        )
    )
    assert published["status"]["state"] in ("COMPLETED", "HOT_LOAD_STATE_COMPLETED", 3), published["status"]
    plane.chain.append(("mh-000000", full_dir))
    loads = [(published["spec"]["id"], "mh-000000")]
    for step in (1, 2, 3):
        identity, prev, _ = next_delta(plane, tmp_path, step)
        hl = hot_load(plane.api, plane.dep_id, identity, prev)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        loads.append((hl["spec"]["id"], identity))
    order = [r["name"] for r in walk_order(plane.settings, plane.dep_id)]
    node_of = {r["name"]: r["node"] for r in replicas}
    for hl_id, identity in loads:
        hl = plane.api.call("GET", f"/hotLoads/{hl_id}").json()["hotLoad"]
        plane.timings.append((identity, seconds(hl)))
        reps = hot_load_replicas(plane.api, hl_id)
        assert [r["name"] for r in reps] == order
        assert [r["state"] for r in reps] == ["READY"] * 3, reps
        assert [r["node"] for r in reps] == [node_of[n] for n in order], reps
        first, *others = reps
        assert first["source"] == "bucket" and first["bytesReadFromBucket"] > 0, (identity, first)
        for r in others:
            assert r["source"] == f"peer:{first['name']}" and r["bytesReadFromBucket"] == 0, (identity, r)
            assert r["node"] != first["node"]  # the transfer crossed hosts
    served_ids = assert_no_mix(plane)
    assert set(served_ids.values()) == {"mh-000003"}
    print("hot-load seconds across 3 hosts:", ", ".join(f"{i} {s:.2f}" for i, s in plane.timings))

    # The gateway and Dynamo's frontend (in the control host) reach the workers across hosts.
    r = httpx.post(
        f"{plane.settings.gateway_url}/v1/completions",
        trust_env=False,
        timeout=120,
        headers={"Authorization": f"Bearer {plane.settings.admin_token}"},
        json={"model": "multihost-model", "prompt": [5, 100, 200], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------ 2
def test_engine_control_is_unreachable_from_another_host(deployment: Plane) -> None:
    plane = deployment
    replicas = plane.replicas()
    for replica in replicas:
        own = plane.host_of(replica)
        other = next(h for n, h in plane.hosts.items() if n != replica["node"])
        secret, port = replica["engineSecret"], replica["engineUrl"].rsplit(":", 1)[1]
        # The worker's control server, at its host's address, from another host: nothing answers.
        url = f"http://{own.address}:{port}/engine/rollouts/"
        for route in ("pause", "collective_rpc", "is_paused"):
            status, text = probe_call(other, "POST", url + route, secret, {"secret": secret})
            assert status in (0, 403), f"{other.name} reached {route} on {own.name}: {status} {text}"
        # Inference answers across hosts, through Dynamo's frontend, from this worker alone.
        body = {
            "model": replica["dynamoModel"],
            "prompt": [5, 6],
            "max_tokens": 2,
            "nvext": {
                "backend_instance_id": int(replica["dynamoWorker"], 16),
                "extra_fields": ["worker_id"],
                "annotations": [request_annotation(replica["dynamoRequestSecret"])],
            },
        }
        frontend = f"{plane.settings.dynamo_frontend_url}/v1/completions"
        status, answer = probe_call(other, "POST", frontend, secret, body, tls=plane.settings.dynamo_tls_dir)
        assert status == 200, f"inference must answer across hosts: {status} {answer}"
        # Without the stack's client certificate, Dynamo's frontend answers nothing (plain HTTP,
        # as curl would send it, or HTTPS trusting nothing): only the gateway reaches a model.
        assert frontend.startswith("https://"), frontend
        for url in (frontend, "http://" + frontend.removeprefix("https://")):
            status, text = probe_call(other, "POST", url, secret, body)
            assert status != 200, f"{other.name} got a completion from Dynamo's frontend without a certificate: {text}"
        assert json.loads(answer)["nvext"]["worker_id"]["decode_worker_id"] == int(replica["dynamoWorker"], 16), answer
        # Its own host reaches the control routes over loopback.
        status, text = probe_call(
            own, "POST", f"http://127.0.0.1:{port}/engine/rollouts/is_paused", secret, {"secret": secret}
        )
        assert status == 200 and '"is_paused":false' in text.replace(" ", "").lower(), (own.name, status, text)
    # Whichever worker's card Dynamo's frontend reads first, it names files that every host reads:
    # the shared discovery directory, not a URL on a worker's loopback-only system server.
    shared = plane.settings.dynamo_discovery_dir / FILES_DIR
    cards = [
        json.loads(p.read_text())["card_json"] for p in (plane.settings.dynamo_discovery_dir / "v1" / "mdc").iterdir()
    ]
    assert len(cards) >= len(replicas), cards
    for card in cards:
        path = Path(card["model_info"]["hf_config_json"]["path"])
        assert path.parent.parent == shared and path.is_file(), card["model_info"]


# ------------------------------------------------------------------------------------ 3
def test_partition_during_the_broadcast_converges(deployment: Plane, tmp_path: Path) -> None:
    plane = deployment
    order = walk_order(plane.settings, plane.dep_id)
    target = next(r for r in order[1:] if r["node"] != LOCAL_NODE)  # a receiver outside the control host
    host = plane.host_of(target)
    identity, prev, _ = next_delta(plane, tmp_path, 4)
    # Admitted first (admission asks every node agent about its replicas), then the link goes
    # down before the first replica leaves its hold, so its broadcast runs inside the partition.
    with first_step_held(plane, order[0]) as fired:
        hl_id = admit(plane, identity, prev)
        fired()
        t_down = time.time()
        host.link_down()
    try:
        time.sleep(max(0.0, t_down + PARTITION_S - time.time()))
    finally:
        host.link_up()
    t_up = time.time()
    hl = plane.api.wait_hot_load(hl_id, timeout=900)
    state = hl["status"]["state"]
    reps = hot_load_replicas(plane.api, hl_id)
    print(
        f"partition of {host.name} ({target['name']}) for {t_up - t_down:.1f}s: operation {state} after "
        f"{seconds(hl):.1f}s; replicas: "
        + "; ".join(
            f"{r['name']}@{r.get('node')} {r['state']} {r.get('currentSnapshotIdentity')} source={r.get('source')} "
            f"error={r.get('errorReason')}"
            for r in reps
        )
    )
    # The premise: the broadcast was sent while the link was down.
    sends = activity_times(plane.settings, hl_id, "send_to_peers")
    assert sends and t_down <= sends[0] <= t_up, (t_down, sends, t_up)
    assert state in ("HOT_LOAD_STATE_COMPLETED", "HOT_LOAD_STATE_FAILED"), hl["status"]
    if state == "HOT_LOAD_STATE_FAILED":
        failed = [r for r in reps if r["state"] == "ERROR"]
        assert failed and all(r.get("errorReason") for r in failed), reps
        assert any(r["name"] in c["message"] for r in failed for c in hl["status"]["conditions"]), hl["status"]
    wait_ready(plane)
    assert_no_mix(plane)
    if state == "HOT_LOAD_STATE_FAILED":
        again = plane.api.wait_hot_load(admit(plane, identity, prev))
        assert again["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", again["status"]
    assert set(assert_no_mix(plane).values()) == {identity}


# ------------------------------------------------------------------------------------ 4
def test_host_death_mid_walk(deployment: Plane, tmp_path: Path) -> None:
    plane = deployment
    order = walk_order(plane.settings, plane.dep_id)
    first = order[0]
    victim = next(r for r in order[1:] if r["node"] != LOCAL_NODE)
    host = plane.host_of(victim)
    identity, prev, _ = next_delta(plane, tmp_path, 5)
    before = {r["name"]: r["currentSnapshotIdentity"] for r in order}
    # The first replica's step waits at its start until the victim's host is dead.
    with first_step_held(plane, first) as fired:
        hl_id = admit(plane, identity, prev)
        fired()
        killed = host.kill_all()
        assert killed, f"nothing ran on {host.name}"
        t_kill = time.time()
    hl = plane.api.wait_hot_load(hl_id, timeout=900)
    reps = {r["name"]: r for r in hot_load_replicas(plane.api, hl_id)}
    print(
        f"{host.name} killed ({len(killed)} processes) while {first['name']} was held: operation "
        f"{hl['status']['state']} {time.time() - t_kill:.1f}s after the kill; conditions "
        f"{[c['message'] for c in hl['status']['conditions']]}; the victim's errorReason "
        f"{reps[victim['name']].get('errorReason')!r}; replicas: "
        + "; ".join(f"{n}@{r.get('node')} {r['state']} {r.get('currentSnapshotIdentity')}" for n, r in reps.items())
    )
    assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
    assert reps[victim["name"]]["state"] == "ERROR"
    why = reps[victim["name"]]["errorReason"]
    assert "lost" in why and host.name in why, why  # the replica's entry: its node was lost
    assert any(victim["name"] in c["message"] for c in hl["status"]["conditions"]), hl["status"]
    # No survivor serves a mix; each serves the identity its entry names.
    for name, r in reps.items():
        if name != victim["name"]:
            assert r["currentSnapshotIdentity"] in (identity, before[name]), r
    # The lost replica runs again on a surviving host, caught up, and the deployment is READY.
    wait_ready(plane)
    moved = next(r for r in plane.replicas() if r["name"] == victim["name"])
    assert moved["node"] != host.name and moved["node"] in plane.hosts, moved
    served_ids = assert_no_mix(plane)
    assert served_ids[victim["name"]] == prev, "the replacement catches up to the deployment's current snapshot"
    again = plane.api.wait_hot_load(admit(plane, identity, prev))
    assert again["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", again["status"]
    assert set(assert_no_mix(plane).values()) == {identity}
    nodes = registry_nodes(plane.settings)
    assert nodes[host.name]["lost"] is True
    print("after the death:", {r["name"]: r["node"] for r in plane.replicas()})
