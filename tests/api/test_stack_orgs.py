"""On the real embedded stack (Temporal, SeaweedFS, API, control worker, gateway): tokens.json
holds only hashes, a second organization added to it while the stack runs works at once, each
bad model/hotLoad path or bucket is refused naming the field (and creates nothing), and two
organizations each create a gateway and a deployment with the same id."""

from __future__ import annotations

import time

import pytest

from contracts.tokens import add_token
from tests.helpers.stack_fixtures import Api, deployment_body

SECOND_ORG = "org-second"
SECOND_TOKEN = "rk-admin-second-organization-test-token"


@pytest.fixture(scope="module")
def apis(stack):
    add_token(stack.tokens_file, SECOND_TOKEN, "admin", SECOND_ORG, "second", buckets=[stack.bucket])
    return Api(stack), Api(stack, SECOND_TOKEN)


def test_tokens_file_holds_no_plain_token(stack, apis):
    text = stack.tokens_file.read_text()
    for token in (stack.admin_token, stack.viewer_token, SECOND_TOKEN):
        assert token not in text
    assert apis[1].call("GET", "/deployments").status_code == 200  # added without a restart


@pytest.mark.parametrize(
    "section, change, status, field",
    [
        ("model", {"path": "../models/base"}, 400, "model.path"),
        ("model", {"path": "/etc/passwd"}, 400, "model.path"),
        ("model", {"path": "s3://other-bucket/x"}, 400, "model.path"),
        ("model", {"path": "models/../../etc"}, 400, "model.path"),
        ("model", {"bucket": "../x"}, 400, "model.bucket"),
        ("model", {"bucket": "other-bucket"}, 403, "model.bucket"),
        ("hotLoad", {"bucket": "other-bucket"}, 403, "hotLoad.bucket"),
        ("hotLoad", {"pathPrefix": "../elsewhere"}, 400, "hotLoad.pathPrefix"),
    ],
)
def test_bad_paths_and_foreign_buckets_are_refused_naming_the_field(stack, apis, section, change, status, field):
    api = apis[0]
    body = deployment_body(stack, "bad-path", replicas=1, path_prefix="checkpoints/bad-path")
    body[section] = {**body[section], **change}
    r = api.call("POST", "/deployments", json=body)
    print(section, change, "->", r.status_code, r.json())
    assert r.status_code == status, r.text
    assert r.json()["code"] == ("invalid_argument" if status == 400 else "permission_denied")
    assert r.json()["message"].startswith(field + ":"), r.json()
    names = [d["spec"]["name"] for d in api.call("GET", "/deployments").json()["items"]]
    assert "bad-path" not in names


def test_two_organizations_each_have_their_own_ids(stack, apis):
    own, second = apis
    # The stack's default gateway id, taken again by the second organization.
    r = second.call("POST", "/gateways", json={"id": stack.gateway_id, "name": "second-gw", "zones": [stack.zone]})
    print("second org creates gateway", stack.gateway_id, "->", r.status_code)
    assert r.status_code == 200, r.text
    assert own.call("GET", f"/gateways/{stack.gateway_id}").json()["gateway"]["spec"]["name"] == "local"
    assert second.call("GET", f"/gateways/{stack.gateway_id}").json()["gateway"]["spec"]["name"] == "second-gw"

    dep_id = "same-deployment-id"
    for api, name in ((own, "own-dep"), (second, "second-dep")):
        body = {**deployment_body(stack, name, replicas=1, path_prefix=f"checkpoints/{name}"), "id": dep_id}
        r = api.call("POST", "/deployments", json=body)
        print(name, "creates deployment", dep_id, "->", r.status_code)
        assert r.status_code == 200, r.text
    try:
        for api, name, org in ((own, "own-dep", stack.organization_id), (second, "second-dep", SECOND_ORG)):
            dep = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]
            assert (dep["spec"]["name"], dep["spec"]["organizationId"]) == (name, org)
            listed = {d["spec"]["name"] for d in api.call("GET", "/deployments").json()["items"]}
            assert name in listed and not {"own-dep", "second-dep"} - {name} & listed
    finally:
        for api in (own, second):
            assert api.call("DELETE", f"/deployments/{dep_id}").status_code == 200
        deadline = time.monotonic() + 180
        while any(api.call("GET", f"/deployments/{dep_id}").status_code != 404 for api in (own, second)):
            assert time.monotonic() < deadline, "deployments not deleted"
            time.sleep(1)
    assert second.call("DELETE", f"/gateways/{stack.gateway_id}").status_code == 200
    assert own.call("GET", f"/gateways/{stack.gateway_id}").status_code == 200
