"""End-to-end fixtures: one 3-replica deployment shared by every test that needs it (vLLM
replicas take about a minute each to start on two cores). Each test starts its own snapshot
chain with a FULL hot-load, so tests do not depend on one another's weights."""

from __future__ import annotations

import pytest

from tests.helpers.replicas import ROLLING_PREFIX
from tests.helpers.stack_fixtures import Api, deployment_body


@pytest.fixture(scope="session")
def rolling(stack):
    api = Api(stack)
    body = deployment_body(stack, "rolling", replicas=3, path_prefix=ROLLING_PREFIX)
    # Long generations, so a request is surely still running when its replica updates.
    body["runtime"]["engineConfig"] = {"max-model-len": "2048"}
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    dep = api.wait_deployment(dep["spec"]["id"])
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    yield api, dep
    api.call("DELETE", f"/deployments/{dep['spec']['id']}")
