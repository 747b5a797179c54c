"""The dynamo stack: an embedded stack whose dynamo-vllm replicas are NVIDIA Dynamo's vLLM workers
behind Dynamo's frontend (``rollouts up --dynamo``), with one 2-replica deployment for the
folder's tests. Both are package-scoped (this folder is a package: ``__init__.py``), so they stop
once the folder's last test ran, before any other folder starts engines. It is a second stack beside the suite's own (free ports of its own); the shared
deployments' pool is released before these tests (tests/conftest.py), so with the replica tests'
engine at most three engines run."""

from __future__ import annotations

import pytest

from common.settings import Settings
from tests.helpers.deployments import delete_deployment
from tests.helpers.dynamo_stack import DYNAMO_PREFIX, REPLICAS
from tests.helpers.stack_fixtures import Api, deployment_body, free_port_base
from workers.stack import Stack


@pytest.fixture(scope="package")
def dynamo_stack(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings.create(tmp_path_factory.mktemp("rollouts-dynamo-home"), free_port_base())
    settings.dynamo = True
    stack = Stack(settings)
    try:
        stack.up(say=lambda line: print(line, flush=True))
        yield settings
    finally:
        stack.down(say=lambda line: print(line, flush=True))


@pytest.fixture(scope="package")
def dyn(dynamo_stack: Settings):
    """(api, deployment) of the folder's 2-replica deployment (max-model-len 2048)."""
    api = Api(dynamo_stack)
    body = deployment_body(dynamo_stack, "dyn", replicas=REPLICAS, path_prefix=DYNAMO_PREFIX)
    body["runtime"]["engineConfig"] = {"max-model-len": "2048"}
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    dep = api.wait_deployment(dep["spec"]["id"])
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    try:
        yield api, dep
    finally:
        delete_deployment(api, dep["spec"]["id"])
