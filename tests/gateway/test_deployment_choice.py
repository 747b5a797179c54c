"""Which deployment a request goes to (``Router.route``, ``gateway/routing.py``), from views built
out of deployment memos as the workflows publish them: no stack, no engine."""

from __future__ import annotations

from collections import Counter

from gateway.routing import Router
from tests.helpers.views import GW, router, view


def chosen(r: Router, model: str | None, count: int, session: str | None = None, org: str = "org") -> Counter:
    out: Counter = Counter()
    for _ in range(count):
        _, v = r.route(model, org, session)
        out[v.deployment_id if v else None] += 1
    return out


def test_views_carry_gateways_weight_and_status():
    v = view("d1", weight=90, status="STATUS_FAILED", gateways=("gw-a", "gw-b"))
    assert (v.gateway_ids, v.weight, v.status, v.takes_traffic) == (("gw-a", "gw-b"), 90, "STATUS_FAILED", False)
    assert view("d2", weight="90").weight == 0  # not an integer: no share
    assert not view("d3", replicas=0).takes_traffic and view("d4").takes_traffic


def test_a_failed_deployment_sharing_the_name_takes_nothing():
    # The failed one first, in the table and by id: the order in which it took every request.
    r = router(view("failed", replicas=0, status="STATUS_FAILED"), view("ready", replicas=2))
    assert chosen(r, "policy", 50) == {"ready": 50}
    # Even when its memo still lists a replica (one of two started before the other failed).
    r = router(view("failed", status="STATUS_FAILED"), view("deleting", status="STATUS_DELETING"), view("ready"))
    assert chosen(r, "policy", 50) == {"ready": 50}
    named, none = r.route("failed", "org")  # addressed by id: named, but no traffic
    assert none is None and [v.deployment_id for v in named] == ["failed"]


def test_none_serving_is_no_choice_but_still_named():
    r = router(view("a", replicas=0), view("b", status="STATUS_FAILED"))
    named, chosen_view = r.route("policy", "org")
    assert chosen_view is None and sorted(v.deployment_id for v in named) == ["a", "b"]
    assert "no running" not in named[0].describe() and "0 running replica(s)" in named[0].describe()


def test_weights_split_exactly():
    r = router(view("big", weight=90), view("small", weight=10))
    assert chosen(r, "policy", 100) == {"big": 90, "small": 10}
    assert chosen(r, "policy", 1000) == {"big": 900, "small": 100}


def test_weight_zero_takes_nothing_by_name_but_answers_by_id():
    r = router(view("on", weight=100), view("off", weight=0))
    assert chosen(r, "policy", 20) == {"on": 20}
    assert chosen(r, "off", 3) == {"off": 3}
    r = router(view("off", weight=0))
    assert chosen(r, "policy", 2) == {None: 2}


def test_only_deployments_listing_this_gateway():
    r = router(
        view("mine", weight=10), view("other", weight=90, gateways=("gw-b",)), view("both", "m2", gateways=("gw-b", GW))
    )
    assert chosen(r, "policy", 30) == {"mine": 30}
    assert r.route("other", "org") == ([], None)  # not even by id: not served here
    assert [v.deployment_id for v in r.models("org")] == ["both", "mine"]
    unfiltered = Router()
    for v in r.views.values():
        unfiltered.set_view(v)
    assert len(unfiltered.models("org")) == 3


def test_another_organization_is_not_found():
    r = router(view("theirs", org="org-b"), view("mine"))
    assert chosen(r, "policy", 5) == {"mine": 5}
    assert r.route("theirs", "org") == ([], None)


def test_two_organizations_may_use_the_same_deployment_id():
    r = router(view("policy-dep", org="org-a"), view("policy-dep", "theirs", org="org-b"))
    assert len(r.views) == 2  # keyed by workflow id, neither replaces the other
    assert r.route("policy", "org-a")[1].organization_id == "org-a"
    assert r.route("policy-dep", "org-b")[1].model_name == "theirs"
    assert r.route("theirs", "org-a") == ([], None)


def test_a_session_stays_on_its_deployment():
    r = router(view("big", weight=90), view("small", weight=10))
    r.pin("traj-1", "small-r0")
    assert chosen(r, "policy", 20, session="traj-1") == {"small": 20}
    r.set_view(view("small", weight=10, status="STATUS_FAILED"))  # its deployment stops taking traffic
    assert chosen(r, "policy", 5, session="traj-1") == {"big": 5}


def test_a_deployment_whose_replicas_all_just_failed_is_chosen_last():
    r = router(view("big", weight=90), view("small", weight=10))
    r.mark_failed("http://127.0.0.1:9000/big")
    assert chosen(r, "policy", 10) == {"small": 10}
    r.mark_failed("http://127.0.0.1:9000/small")  # both cooling: the split applies again
    assert chosen(r, "policy", 100) == {"big": 90, "small": 10}


def test_no_model_goes_to_the_one_model_served():
    r = router(view("a", weight=1), view("b", weight=1))
    assert chosen(r, None, 4) == {"a": 2, "b": 2}
    r.set_view(view("c", "other-model"))
    assert r.route(None, "org") == ([], None)
