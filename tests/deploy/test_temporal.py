"""deploy/kubernetes/temporal/: the Helm values parse and configure what the rollouts manifests
expect, and the search-attribute Job registers exactly common/settings.py's SEARCH_ATTRIBUTES.

The Job's shell script runs here, unchanged, against a Temporal dev server on loopback with no
search attribute registered (the ``temporal`` CLI of the project venv stands in for the admin-tools
image's): afterwards the namespace holds every attribute with its type, and a second run (a Job
retried, or run again after an upgrade) succeeds and changes nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess

import kubernetes_validate
from temporalio.testing import WorkflowEnvironment

from common.settings import SEARCH_ATTRIBUTES
from tests.helpers.deploy_files import DEPLOY, KUBERNETES_VERSION, REPO, find, load_yaml_documents, render

TEMPORAL = DEPLOY / "kubernetes" / "temporal"
VENV_BIN = REPO / ".venv" / "bin"
CREATE = re.compile(r"^temporal operator search-attribute create .*--name (\S+) --type (\S+)$", re.MULTILINE)


def job() -> dict:
    (doc,) = load_yaml_documents(TEMPORAL / "search-attributes-job.yaml")
    return doc


def job_script_and_env() -> tuple[str, dict[str, str]]:
    (c,) = job()["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    return script, {e["name"]: e["value"] for e in c["env"]}


def test_the_values_file_configures_what_rollouts_expects():
    (values,) = load_yaml_documents(TEMPORAL / "values.yaml")
    config = values["server"]["config"]
    stores = config["persistence"]["datastores"]
    assert set(stores) == {config["persistence"]["defaultStore"], config["persistence"]["visibilityStore"]}
    for store in stores.values():
        assert store["sql"]["pluginName"] == "postgres12" and store["sql"]["existingSecret"]
    # The namespace the rollouts processes use is one the chart creates.
    data = find(render("base"), "ConfigMap", "rollouts-config")["data"]
    assert data["TEMPORAL_NAMESPACE"] in {n["name"] for n in config["namespaces"]["namespace"]}
    assert config["namespaces"]["create"] is True
    # Release `temporal` in namespace `temporal`: the chart's frontend Service the ConfigMap names.
    assert data["TEMPORAL_ADDRESS"] == "temporal-frontend.temporal.svc.cluster.local:7233"
    assert values["server"]["frontend"]["replicaCount"] >= 2


def test_the_job_is_valid_and_registers_exactly_the_settings_search_attributes():
    kubernetes_validate.validate(job(), KUBERNETES_VERSION, strict=True)
    script, env = job_script_and_env()
    assert dict(CREATE.findall(script)) == SEARCH_ATTRIBUTES
    assert len(CREATE.findall(script)) == len(SEARCH_ATTRIBUTES)
    data = find(render("base"), "ConfigMap", "rollouts-config")["data"]
    assert env == {"TEMPORAL_ADDRESS": data["TEMPORAL_ADDRESS"], "TEMPORAL_NAMESPACE": data["TEMPORAL_NAMESPACE"]}


def _indexed_type(name: str) -> str:
    """`KeywordList` -> `INDEXED_VALUE_TYPE_KEYWORD_LIST`, as `search-attribute list -o json` prints."""
    return "INDEXED_VALUE_TYPE_" + re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


async def test_the_job_script_registers_them_on_a_temporal_server(tmp_path):
    script, _ = job_script_and_env()
    server = await WorkflowEnvironment.start_local(dev_server_existing_path=str(VENV_BIN / "temporal"))
    try:
        env = {
            **os.environ,
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "HOME": str(tmp_path),
            "TEMPORAL_ADDRESS": server.client.service_client.config.target_host,
            "TEMPORAL_NAMESPACE": "default",
        }

        def registered() -> dict[str, str]:
            listed = subprocess.run(
                ["temporal", "operator", "search-attribute", "list", "--namespace", "default", "-o", "json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return json.loads(listed.stdout).get("customAttributes", {})

        assert not set(SEARCH_ATTRIBUTES) & set(registered())  # the premise: none is there yet
        for attempt in (1, 2):
            done = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"run {attempt}: {done.stderr}"
            custom = registered()
            assert {name: custom.get(name) for name in SEARCH_ATTRIBUTES} == {
                name: _indexed_type(kind) for name, kind in SEARCH_ATTRIBUTES.items()
            }
    finally:
        await server.shutdown()
