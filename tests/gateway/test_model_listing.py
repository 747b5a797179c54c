"""Unit test: the gateway's ``GET /v1/models`` (gateway/listing.py) lists each model name once,
however many deployments serve it, from views built out of deployment memos: no stack."""

from __future__ import annotations

from gateway.listing import model_list
from tests.helpers.views import router, view


def test_a_model_name_two_deployments_serve_is_listed_once():
    r = router(
        view("d2", "policy", replicas=2, weight=10),
        view("d1", "policy", status="STATUS_FAILED", replicas=0),
        view("d3", "other"),
        view("d4", "policy", org="org-b"),
    )
    views = r.models("org")
    # The premise: two deployments of this organization serve the name "policy".
    assert sorted(v.deployment_id for v in views if v.model_name == "policy") == ["d1", "d2"]
    listed = model_list(views)
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["other", "policy"]
    policy = listed["data"][1]
    assert {k: policy[k] for k in ("object", "owned_by", "root", "takes_traffic")} == {
        "object": "model",
        "owned_by": "rollouts",
        "root": "policy",
        "takes_traffic": True,
    }
    assert [
        (d["deployment_id"], d["status"], d["takes_traffic"], d["weight"], len(d["replicas"]))
        for d in policy["deployments"]
    ] == [("d1", "STATUS_FAILED", False, 100, 0), ("d2", "STATUS_READY", True, 10, 2)]
    assert policy["deployments"][1]["replicas"][0] == {"name": "d2-r0", "identity": "initial", "settled": True}


def test_a_name_no_deployment_takes_traffic_for_says_so():
    listed = model_list(router(view("d1", "policy", weight=0), view("d2", "policy", replicas=0)).models("org"))
    assert [(m["id"], m["takes_traffic"], len(m["deployments"])) for m in listed["data"]] == [("policy", False, 2)]
