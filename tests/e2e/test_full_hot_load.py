"""The vertical slice, end to end on the real stack, driven by the real cwtrain CLI.

Temporal dev server, SeaweedFS, the API, the control worker, the gateway and two vLLM CPU
replicas. A trainer creates a deployment, checks its bucket access, publishes a FULL checkpoint
that changes greedy behaviour in a way we can predict (the "counting" model: after token i it
says i+1), and every replica serves it without a restart.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.helpers.ready import first_requests_served
from tests.helpers.replicas import replicas_of
from tests.helpers.stack_fixtures import Api, cwtrain, deployment_body, json_out, require_cwtrain
from workers.base_model import write_counting_model

pytestmark = pytest.mark.stack

PROMPT_IDS = [5, 100, 200, 300]
GEN = 8


def greedy_ids(settings, model: str) -> list[int]:
    r = httpx.post(
        f"{settings.gateway_url}/v1/completions",
        headers={"Authorization": f"Bearer {settings.admin_token}"},
        json={
            "model": model,
            "prompt": PROMPT_IDS,
            "max_tokens": GEN,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
            "nvext": {"extra_fields": ["completion_token_ids"]},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return list(r.json()["nvext"]["completion_token_ids"])


@pytest.fixture(scope="module")
def cw_deployment(stack, tmp_path_factory):
    require_cwtrain()
    body = deployment_body(stack, "e2e-full", replicas=2, path_prefix="checkpoints/e2e-full")
    path = tmp_path_factory.mktemp("req") / "deployment.json"
    path.write_text(json.dumps(body))
    t0 = time.monotonic()
    out = json_out(cwtrain(stack, "deployment", "create", "--file", str(path), "--wait", "--timeout", "1200"))
    print(f"deployment ready in {time.monotonic() - t0:.1f}s")
    # A trainer's next step after `create --wait`: rollouts, at once.
    first_requests_served(stack, out["id"])
    yield out
    # Free the two replicas for the tests that follow (cwtrain waits until it is gone).
    json_out(cwtrain(stack, "deployment", "delete", out["id"], "--wait"))


def test_cwtrain_publishes_full_checkpoint_and_every_replica_serves_it(stack, cw_deployment, tmp_path):
    api = Api(stack)
    dep_id = cw_deployment["id"]
    assert cw_deployment["status"] == "READY" or cw_deployment["status"] in (6, "STATUS_READY"), cw_deployment
    model = cw_deployment["model_name"]
    assert cw_deployment["endpoints"] == [stack.gateway_url]

    # The served engines before: their pids must survive the hot-load.
    memo_replicas = replicas_of(stack, dep_id)
    assert len(memo_replicas) == 2
    pids_before = {r["name"]: r["enginePid"] for r in memo_replicas}

    before = greedy_ids(stack, model)
    counting = write_counting_model(stack.home_path / "models" / "base", tmp_path / "counting")
    expected = [PROMPT_IDS[-1] + 1 + i for i in range(GEN)]
    assert before != expected, "the base model must not already count"

    check = json_out(cwtrain(stack, "hotload", "check", "--deployment", dep_id))
    assert check["result"] == "ok"

    t0 = time.monotonic()
    published = json_out(
        cwtrain(
            stack,
            "hotload",
            "publish",
            "--deployment",
            dep_id,
            "--checkpoint",
            str(counting),
            "--identity",
            "step-000001",
        )
    )
    print(f"full hot-load published+completed in {time.monotonic() - t0:.1f}s")
    hot_load_id = published["spec"]["id"]
    assert published["status"]["state"] in ("COMPLETED", "HOT_LOAD_STATE_COMPLETED", 3)

    status = json_out(cwtrain(stack, "hotload", "status", hot_load_id))
    replicas = status["replicas"]
    assert len(replicas) == 2
    for r in replicas:
        assert r["state"] in ("READY", 3), r
        assert r["current_snapshot_identity"] == "step-000001"
        assert r["started_at"] and r["finished_at"] and r["transitioned_at"]

    listed = json_out(cwtrain(stack, "hotload", "list", "--deployment", dep_id))
    assert [h["spec"]["id"] for h in listed][:1] == [hot_load_id]

    wire = api.call("GET", f"/hotLoads/{hot_load_id}").json()["hotLoad"]
    assert wire["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    assert wire["spec"]["snapshotChain"] == [
        {"identity": "step-000001", "type": "SNAPSHOT_TYPE_FULL", "hotLoadId": hot_load_id}
    ]
    assert wire["status"]["finishedAt"] >= wire["status"]["createdAt"]

    # Same engine processes, new behaviour on every replica.
    after_replicas = replicas_of(stack, dep_id)
    assert {r["name"]: r["enginePid"] for r in after_replicas} == pids_before
    for r in after_replicas:
        os.kill(r["enginePid"], 0)  # still alive
        assert r["currentSnapshotIdentity"] == "step-000001"
    for _ in range(4):  # least-loaded routing spreads these over both replicas
        assert greedy_ids(stack, model) == expected

    # Engineers inspect the operation in the Temporal UI: the link answers.
    assert httpx.get(wire["status"]["workflowUrl"], timeout=30).status_code == 200
