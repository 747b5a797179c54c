"""Fixtures for the gateway tests: ONE 2-replica ``dynamo-vllm`` deployment (real Dynamo vLLM
workers on CPU, behind Dynamo's frontend) behind the stack's real gateway, shared by every test
here (``gw``), and, for the gateway's own routing, ONE 2-replica ``vllm`` deployment (vLLM's
OpenAI servers, no hot-loads: ``vllm_gw``); tests/helpers/deployments.py's pool keeps one of them
at a time (tests/helpers/gateway.py has what the tests do with them). Each is created as a
trainer would: created, waited for READY, then 16 requests sent at once, each answered 200
(tests/helpers/ready.py).

Development: ``ROLLOUTS_TEST_STACK_HOME=DIR`` (a stack started with ``rollouts up --home DIR``)
and ``ROLLOUTS_TEST_DEPLOYMENT_ID=ID`` (a READY 2-replica deployment on it) reuse a running
stack and deployment instead of starting them; nothing is stopped at the end then.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from common.settings import Settings
from tests.helpers.deployments import POOL, delete_deployment
from tests.helpers.gateway import PREFIX, GatewayDeployment, Served
from tests.helpers.ready import served_or_deleted
from tests.helpers.stack_fixtures import Api, deployment_body

REPLICAS = 2

if os.environ.get("ROLLOUTS_TEST_STACK_HOME"):
    # Development: reuse a running stack (see the docstring); otherwise tests/conftest.py's
    # session stack, shared with every other suite of the run.
    @pytest.fixture(scope="session")
    def stack():
        return Settings.own(Path(os.environ["ROLLOUTS_TEST_STACK_HOME"]))


def _create(stack: Settings, engine: str = "dynamo-vllm") -> GatewayDeployment:
    api = Api(stack)
    body = deployment_body(
        stack, "gwtest" if engine == "dynamo-vllm" else "gwvllm", replicas=REPLICAS, path_prefix=PREFIX
    )
    if engine != "dynamo-vllm":
        body["runtime"]["engine"] = engine
        del body["hotLoad"]  # only dynamo-vllm hot-loads
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    dep = api.wait_deployment(dep["spec"]["id"])
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    served_or_deleted(stack, api, dep["spec"]["id"])  # the gateway serves what the API called READY
    headers = {"Authorization": f"Bearer {stack.admin_token}"}
    models = httpx.get(f"{stack.gateway_url}/v1/models", headers=headers).json()
    assert any(
        d["deployment_id"] == dep["spec"]["id"] and len(d["replicas"]) == REPLICAS
        for m in models["data"]
        for d in m["deployments"]
    ), models
    return GatewayDeployment(stack, api, dep)


@pytest.fixture(scope="module")
def gw(stack) -> GatewayDeployment:
    reuse = os.environ.get("ROLLOUTS_TEST_DEPLOYMENT_ID")
    if reuse:
        api = Api(stack)
        dep = api.call("GET", f"/deployments/{reuse}").json()["deployment"]
        # It may serve anything: tests that need known weights publish them first (serve_full).
        return POOL.get(
            "gw",
            0,
            lambda: GatewayDeployment(
                stack, api, dep, Served(dep["status"].get("currentSnapshotIdentity") or "initial")
            ),
            lambda _: None,
        )
    return POOL.get("gw", REPLICAS, lambda: _create(stack), lambda g: delete_deployment(g.api, g.id))


@pytest.fixture(scope="module")
def vllm_gw(stack) -> GatewayDeployment:
    """A ``runtime.engine: vllm`` deployment: the gateway routes to its replicas itself."""
    return POOL.get("gw-vllm", REPLICAS, lambda: _create(stack, "vllm"), lambda g: delete_deployment(g.api, g.id))
