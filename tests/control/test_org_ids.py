"""Ids per organization (contracts/names.py), on the real Temporal dev server through the real API:
two organizations each create a gateway, a deployment and a hot-load with the same ids; both
succeed, each sees only its own, deleting one leaves the other, and a third organization finds
neither."""

from __future__ import annotations

from typing import Any

from contracts.names import deployment_workflow_id, hot_load_workflow_id
from tests.helpers.harness import ADMIN, DISABLED_ORG, ORG, OTHER_ORG, ZONE, Fleet, poll, write_full

SAME = "same-id"


async def _wait_hot_load(f: Fleet, token: str, hl_id: str) -> dict[str, Any]:
    async def check() -> dict | None:
        hl = (await f.call("GET", f"/hotLoads/{hl_id}", token=token)).json()["hotLoad"]
        return hl if hl["status"]["state"].endswith(("COMPLETED", "FAILED", "CANCELED")) else None

    return await poll(check, 90, f"hot-load {hl_id}")


async def test_two_organizations_each_have_their_own_ids(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        orgs = {ADMIN: ORG, OTHER_ORG: "org-b"}
        for token, org in orgs.items():
            r = await f.call(
                "POST", "/gateways", token=token, json={"id": SAME, "name": f"gw of {org}", "zones": [ZONE]}
            )
            assert r.status_code == 200, r.text
            body = {
                "id": SAME,
                "name": f"dep of {org}",
                "gatewayIds": [SAME],
                "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
                "model": {"name": f"m-{org}", "bucket": "rollouts", "path": "models/base"},
                "autoscaling": {"min": 2, "max": 2},
                "hotLoad": {"bucket": "rollouts", "pathPrefix": f"ckpt/{SAME}"},
            }
            r = await f.call("POST", "/deployments", token=token, json=body)
            assert r.status_code == 200, r.text
        for token, org in orgs.items():
            dep = await f.wait_deployment(SAME, token=token)
            assert (dep["spec"]["organizationId"], dep["spec"]["name"]) == (org, f"dep of {org}")
            gw = (await f.call("GET", f"/gateways/{SAME}", token=token)).json()["gateway"]
            assert gw["spec"]["name"] == f"gw of {org}"
            # Other tests of the session may list deployments of their own: look at ours by id.
            listed = (await f.call("GET", "/deployments", token=token)).json()["items"]
            assert all(d["spec"]["organizationId"] == org for d in listed), listed
            assert [d["spec"]["name"] for d in listed if d["spec"]["id"] == SAME] == [f"dep of {org}"]
            desc = await f.client.get_workflow_handle(deployment_workflow_id(org, SAME)).describe()
            assert desc.status is not None and desc.status.name == "RUNNING"

        # Both deployments read the same test bucket tree (ckpt/same-id): one snapshot serves both.
        write_full(f.bucket_root / f"ckpt/{SAME}", "step-1")
        for token in orgs:
            r = await f.create_hot_load(SAME, "step-1", token=token, hotLoadId=SAME)
            assert r.status_code == 200, r.text
        for token, org in orgs.items():
            hl = await _wait_hot_load(f, token, SAME)
            assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl
            assert hl["spec"]["organizationId"] == org
            assert hl["status"]["workflowUrl"].endswith(hot_load_workflow_id(org, SAME).replace("/", "%2F"))
            listed = (await f.call("GET", "/hotLoads", token=token)).json()["hotLoads"]
            assert all(h["spec"]["organizationId"] == org for h in listed), listed
            assert [h["spec"]["id"] for h in listed if h["spec"]["id"] == SAME] == [SAME]
            # The same id again within one organization is still already_exists.
            again = await f.create_hot_load(SAME, "step-1", token=token, hotLoadId=SAME)
            assert again.status_code == 409 and again.json()["code"] == "already_exists"

        # A third organization finds none of them.
        for path in (f"/deployments/{SAME}", f"/gateways/{SAME}", f"/hotLoads/{SAME}"):
            r = await f.call("GET", path, token=DISABLED_ORG)
            assert r.status_code == 404 and r.json()["code"] == "not_found", (path, r.text)

        # Deleting org-b's deployment leaves org-a's serving.
        async def idle() -> bool | None:
            dep = (await f.call("GET", f"/deployments/{SAME}", token=OTHER_ORG)).json()["deployment"]
            return True if not dep["status"].get("activeHotLoadId") else None

        await poll(idle, 60, "org-b's deployment idle")
        assert (await f.call("DELETE", f"/deployments/{SAME}", token=OTHER_ORG)).status_code == 200

        async def gone() -> bool | None:
            r = await f.call("GET", f"/deployments/{SAME}", token=OTHER_ORG)
            return True if r.status_code == 404 else None

        await poll(gone, 60, "org-b's deployment deleted")
        dep = (await f.call("GET", f"/deployments/{SAME}", token=ADMIN)).json()["deployment"]
        assert dep["status"]["status"] == "STATUS_READY" and dep["spec"]["organizationId"] == ORG
