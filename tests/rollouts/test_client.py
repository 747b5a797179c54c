"""Unit tests of rollouts.client against a fake REST API (httpx.MockTransport) and a fake S3;
the real stack runs it in tests/gateway/test_on_policy.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollouts.client import (
    INDEX_NAME,
    RESET_ALL,
    ApiError,
    RolloutsClient,
    RoundFailed,
    RoundGate,
    on_policy_round,
    upload_checkpoint,
)


def hot_load(id_: str, state: str, identity: str = "step-1", policy: str = RESET_ALL) -> dict[str, Any]:
    return {
        "spec": {
            "id": id_,
            "deploymentId": "dep",
            "identity": identity,
            "type": "SNAPSHOT_TYPE_FULL",
            "promptCachePolicy": policy,
            "snapshotChain": [{"identity": identity}],
        },
        "status": {"state": state},
    }


class FakeApi:
    """Answers like the REST API; records what it was sent."""

    def __init__(self, *, final_state: str = "HOT_LOAD_STATE_COMPLETED", busy_once: bool = False) -> None:
        self.sent: list[tuple[str, str, Any]] = []
        self.final_state = final_state
        self.busy_once = busy_once
        self.polls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/v1alpha1/inference")
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, path, body))
        if path == "/deployments/dep":
            return httpx.Response(
                200, json={"deployment": {"spec": {"id": "dep", "hotLoad": {"bucket": "b", "pathPrefix": "ck/p"}}}}
            )
        if request.method == "POST" and path == "/hotLoads":
            if self.busy_once:
                self.busy_once = False
                return httpx.Response(
                    412, json={"code": "failed_precondition", "message": "hot-load other is already in progress"}
                )
            return httpx.Response(
                200, json={"hotLoad": hot_load(body["hotLoadId"], "HOT_LOAD_STATE_PENDING", body["identity"])}
            )
        if path == "/hotLoads":
            return httpx.Response(200, json={"hotLoads": [hot_load("other", "HOT_LOAD_STATE_COMPLETED")]})
        if path.endswith("/replicas"):
            token = request.url.params.get("pageToken")
            state = "READY" if self.final_state.endswith("COMPLETED") else "ERROR"
            page = {
                "replicas": [
                    {
                        "name": "r2" if token else "r1",
                        "state": state,
                        "currentSnapshotIdentity": "step-1",
                        "errorReason": None if state == "READY" else "bad checksum",
                    }
                ]
            }
            if not token:
                page["nextPageToken"] = "t1"
            return httpx.Response(200, json=page)
        if path.startswith("/hotLoads/"):
            self.polls += 1
            state = self.final_state if self.polls > 1 else "HOT_LOAD_STATE_IN_PROGRESS"
            return httpx.Response(200, json={"hotLoad": hot_load(path.split("/")[2], state)})
        return httpx.Response(404, json={"code": "not_found", "message": path})


class FakeS3:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def upload_file(self, filename: str, bucket: str, key: str) -> None:
        self.keys.append(f"{bucket}/{key}")


def client_for(api: FakeApi) -> RolloutsClient:
    return RolloutsClient("http://api", "tok", transport=httpx.MockTransport(api))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    for name in ("model-00001-of-00001.safetensors", INDEX_NAME, "config.json"):
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_create_hot_load_bodies_and_busy_wait():
    api = FakeApi(busy_once=True)
    client = client_for(api)
    hl = client.create_hot_load("dep", "step-2", previous_identity="step-1", hot_load_id="hl-x")
    assert hl.id == "hl-x" and hl.identity == "step-2"
    posts = [b for m, p, b in api.sent if m == "POST"]
    assert len(posts) == 2 and posts[0] == posts[1]  # retried after the other hot-load ended
    assert posts[0]["type"] == "SNAPSHOT_TYPE_INCREMENTAL"
    assert posts[0]["incrementalSnapshotMetadata"]["previousSnapshotIdentity"] == "step-1"
    client.create_hot_load("dep", "step-3")
    assert api.sent[-1][2]["type"] == "SNAPSHOT_TYPE_FULL" and "incrementalSnapshotMetadata" not in api.sent[-1][2]


def test_errors_raise_api_error_and_replicas_are_paged():
    client = client_for(FakeApi())
    with pytest.raises(ApiError) as exc:
        client._call("GET", "/nothing")
    assert exc.value.status == 404 and exc.value.code == "not_found"
    assert [r.name for r in client.list_replicas("hl")] == ["r1", "r2"]


def test_upload_puts_the_index_last(checkpoint):
    s3 = FakeS3()
    upload_checkpoint(s3, checkpoint, "b", "/ck/p/", "step-1")
    assert s3.keys[-1] == f"b/ck/p/step-1/{INDEX_NAME}" and len(s3.keys) == 3


def test_gate_holds_new_requests_while_closed():
    gate = RoundGate()
    with gate.request():
        gate.close()
        assert not gate.wait_idle(0.05)
    assert gate.wait_idle(0.05)
    entered = threading.Event()

    def late() -> None:
        with gate.request():
            entered.set()

    t = threading.Thread(target=late)
    t.start()
    time.sleep(0.1)
    assert not entered.is_set()
    gate.open()
    t.join(5)
    assert entered.is_set() and gate.in_flight == 0


def test_on_policy_round_waits_then_reopens(checkpoint):
    api, s3, gate = FakeApi(), FakeS3(), RoundGate()
    client = client_for(api)
    result = on_policy_round(client, "dep", checkpoint, "step-1", gate=gate, s3=s3)
    assert gate.is_open and result.hot_load.state == "HOT_LOAD_STATE_COMPLETED"
    create = next(b for m, p, b in api.sent if m == "POST")
    assert create["promptCachePolicy"] == RESET_ALL and create["type"] == "SNAPSHOT_TYPE_FULL"
    assert all(k.startswith("b/ck/p/step-1/") for k in s3.keys)


def test_a_failed_round_raises_and_keeps_the_gate_closed(checkpoint):
    gate = RoundGate()
    with pytest.raises(RoundFailed, match="bad checksum"):
        on_policy_round(
            client_for(FakeApi(final_state="HOT_LOAD_STATE_FAILED")),
            "dep",
            checkpoint,
            "step-1",
            gate=gate,
            s3=FakeS3(),
        )
    assert not gate.is_open
