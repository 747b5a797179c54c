"""End-to-end fixtures: one 3-replica deployment shared by every test that needs it (vLLM
replicas take about a minute each to start on two cores). It lives in tests/helpers/deployments.py's
pool: the e2e modules that use it run together, and it is deleted before a module that starts
engines of its own, so no more than three engines run at once. Each test starts its own snapshot
chain with a FULL hot-load, so tests do not depend on one another's weights."""

from __future__ import annotations

import pytest

from tests.helpers.deployments import POOL, delete_deployment
from tests.helpers.ready import served_or_deleted
from tests.helpers.replicas import ROLLING_PREFIX
from tests.helpers.stack_fixtures import Api, deployment_body

REPLICAS = 3


def _create(stack) -> tuple[Api, dict]:
    api = Api(stack)
    body = deployment_body(stack, "rolling", replicas=REPLICAS, path_prefix=ROLLING_PREFIX)
    # Long generations, so a request is surely still running when its replica updates.
    body["runtime"]["engineConfig"] = {"max-model-len": "2048"}
    # One receiver per sender: the third replica stages from the second, which passes its own
    # stage on (the fan-out's relay, on real engines).
    body["hotLoad"]["peerFanOut"] = 1
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    dep = api.wait_deployment(dep["spec"]["id"])
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    served_or_deleted(stack, api, dep["spec"]["id"])
    return api, dep


@pytest.fixture(scope="module")
def rolling(stack) -> tuple[Api, dict]:
    return POOL.get(
        "rolling", REPLICAS, lambda: _create(stack), lambda made: delete_deployment(made[0], made[1]["spec"]["id"])
    )
