"""API validation, auth and error mapping, without Temporal: every bad request is a clear 4xx
naming the field, in the `{"code", "message", "details"}` shape cwtrain parses."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from api.app import PREFIX, allowed_hot_load_engines, create_app
from api.models import RuntimeIn
from api.resources import page, update_error
from common.settings import Settings
from contracts.engine_config import engine_config_problem
from contracts.errors import InvalidArgument
from contracts.records import Resources, Runtime
from contracts.tokens import add_token
from tests.helpers.no_temporal import NoTemporal


@pytest.fixture()
def client(tmp_path):
    settings = Settings.create(tmp_path, 30000)
    add_token(settings.tokens_file, "admin-t", "admin", "org-a", "admin")
    add_token(settings.tokens_file, "viewer-t", "viewer", "org-a", "viewer")
    add_token(settings.tokens_file, "other-t", "admin", "org-off", "other", hot_load_enabled=False)
    with TestClient(create_app(settings, temporal_client=NoTemporal())) as c:
        yield c


def post(client, path, body, token="admin-t"):
    return client.post(f"{PREFIX}{path}", json=body, headers={"Authorization": f"Bearer {token}"})


GOOD_HOT_LOAD = {"deploymentId": "d1", "identity": "step-1", "type": "SNAPSHOT_TYPE_FULL"}


def deployment_body(engine: str = "dynamo-vllm", engine_config: dict | None = None, **extra: object) -> dict:
    """A deployment request on ``engine`` (with ``engineConfig`` when given) that names every
    required field, and the ``extra`` fields."""
    runtime = {"engine": engine} if engine_config is None else {"engine": engine, "engineConfig": engine_config}
    return {
        "name": "d",
        "gatewayIds": ["g"],
        "runtime": runtime,
        "model": {"name": "m", "bucket": "bkt", "path": "p"},
        **extra,
    }


def test_missing_token_is_unauthenticated(client):
    r = client.get(f"{PREFIX}/hotLoads/x")
    assert r.status_code == 401
    assert r.json()["code"] == "unauthenticated"
    assert set(r.json()) == {"code", "message", "details"}


def test_unknown_token_is_unauthenticated(client):
    r = client.get(f"{PREFIX}/hotLoads/x", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_viewer_cannot_create(client):
    r = post(client, "/hotLoads", GOOD_HOT_LOAD, token="viewer-t")
    assert r.status_code == 403
    assert r.json()["code"] == "permission_denied"


@pytest.mark.parametrize(
    "identity, words",
    [
        ("a/b", "single path segment"),
        ("..", ".."),
        ("x" * 129, "at most 128"),
        ("initial", "reserved"),
        ("", "non-empty"),
    ],
)
def test_bad_identity_names_the_field(client, identity, words):
    r = post(client, "/hotLoads", {**GOOD_HOT_LOAD, "identity": identity})
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "invalid_argument"
    assert "identity" in body["message"] and words in body["message"]


def test_unknown_enum_name_lists_the_valid_ones(client):
    r = post(client, "/hotLoads", {**GOOD_HOT_LOAD, "type": "SNAPSHOT_TYPE_WHOLE"})
    assert r.status_code == 400
    assert "type" in r.json()["message"] and "SNAPSHOT_TYPE_FULL" in r.json()["message"]


def test_unsupported_compression_is_refused(client):
    body = {
        **GOOD_HOT_LOAD,
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {
            "previousSnapshotIdentity": "s0",
            "compressionFormat": "COMPRESSION_FORMAT_LZ4",
        },
    }
    r = post(client, "/hotLoads", body)
    assert r.status_code == 400
    assert "compressionFormat" in r.json()["message"]


def test_wrong_types_and_unknown_fields_are_named(client):
    r = post(client, "/hotLoads", {**GOOD_HOT_LOAD, "identity": 7, "surprise": True})
    assert r.status_code == 400
    msg = r.json()["message"]
    assert "identity" in msg and "surprise: unknown field" in msg


def test_enum_numbers_are_accepted_by_validation(client):
    # 1 = SNAPSHOT_TYPE_FULL; validation passes and the request reaches the (absent) store.
    with pytest.raises(AssertionError, match="before Temporal"):
        post(client, "/hotLoads", {**GOOD_HOT_LOAD, "type": 1})


def test_oversized_body_is_refused(client):
    r = client.post(
        f"{PREFIX}/hotLoads",
        content=json.dumps({**GOOD_HOT_LOAD, "identity": "x" * (2 << 20)}),
        headers={"Authorization": "Bearer admin-t", "content-type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json() == {"code": "payload_too_large", "message": "request body larger than 1048576 bytes", "details": []}


def test_deployment_hot_load_needs_enabled_org_and_engine(client):
    body = deployment_body(hotLoad={"bucket": "bkt", "pathPrefix": "ckpt"})
    r = post(client, "/deployments", body, token="other-t")
    assert r.status_code == 412
    assert r.json()["message"] == "hot-load is not enabled for this organization"
    r = post(client, "/deployments", {**body, "runtime": {"engine": "vllm"}})
    assert r.status_code == 400 and "runtime.engine" in r.json()["message"]
    assert "hot-loading needs 'dynamo-vllm'" in r.json()["message"]


def test_the_engine_is_one_the_service_runs(client):
    body = deployment_body("sglang")
    r = post(client, "/deployments", body)
    assert r.status_code == 400
    assert "runtime.engine" in r.json()["message"] and "'sglang'" in r.json()["message"]
    assert "dynamo-vllm, vllm" in r.json()["message"]
    r = client.get(f"{PREFIX}/deployments/parameters", headers={"Authorization": "Bearer admin-t"})
    assert {rt["engine"]: rt["hotLoadSupported"] for rt in r.json()["runtimes"]} == {"dynamo-vllm": True, "vllm": False}
    r = post(client, "/deployments", {**body, "hotLoad": {"bucket": "bkt", "pathPrefix": "a/../b"}})
    assert r.status_code == 400 and "pathPrefix" in r.json()["message"]


def test_unknown_route_is_not_found_json(client):
    r = client.get(f"{PREFIX}/nothing", headers={"Authorization": "Bearer admin-t"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


@pytest.mark.parametrize(
    "code, status",
    [("failed_precondition", 412), ("invalid_argument", 400), ("already_exists", 409), ("not_found", 404)],
)
def test_update_failures_map_to_their_codes(code, status):
    exc = WorkflowUpdateFailedError(ApplicationError("hot-load h1 is already in progress", type=code))
    err = update_error(exc)
    assert err.code == code and err.http_status == status
    assert err.message == "hot-load h1 is already in progress"


def test_pagination_tokens_walk_and_are_scoped():
    items = list(range(7))
    first, token = page(items, 3, None, "s")
    assert first == [0, 1, 2] and token
    second, token2 = page(items, 3, token, "s")
    assert second == [3, 4, 5]
    last, token3 = page(items, 3, token2, "s")
    assert last == [6] and token3 is None
    with pytest.raises(InvalidArgument):
        page(items, 3, token, "other-filter")
    with pytest.raises(InvalidArgument):
        page(items, 3, "garbage!", "s")
    assert page(items, 5000, None, "s")[0] == items  # capped at 1000, not refused


# --------------------------------------------------------------------------- auth comes first
@pytest.mark.parametrize(
    "method, path, content",
    [
        ("POST", "/hotLoads", json.dumps({"identity": 7, "surprise": True})),
        ("POST", "/hotLoads", "{not json"),
        ("POST", "/hotLoads", json.dumps({**GOOD_HOT_LOAD, "identity": "x" * (2 << 20)})),
        ("POST", "/hotLoads/h1:cancel", "{}"),
        ("PATCH", "/deployments/d1", json.dumps({"traffic": {"weight": "lots"}})),
        ("DELETE", "/deployments/d1", None),
        ("POST", "/deployments", "[]"),
    ],
)
def test_viewer_write_is_permission_denied_before_the_body_is_read(client, method, path, content):
    r = client.request(
        method,
        f"{PREFIX}{path}",
        content=content,
        headers={"Authorization": "Bearer viewer-t", "content-type": "application/json"},
    )
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "permission_denied"
    assert "Inference Admin role" in r.json()["message"]


def test_invalid_body_without_a_token_is_unauthenticated(client):
    r = client.post(f"{PREFIX}/hotLoads", content="{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_permission_message_names_the_action(client):
    r = post(client, "/hotLoads/h1:cancel", {}, token="viewer-t")
    assert "canceling a hot-load" in r.json()["message"]
    r = post(client, "/hotLoads", GOOD_HOT_LOAD, token="viewer-t")
    assert "creating a hot-load" in r.json()["message"]


# --------------------------------------------------------------------------- request shape
def test_full_with_incremental_metadata_is_invalid(client):
    body = {**GOOD_HOT_LOAD, "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "s0"}}
    r = post(client, "/hotLoads", body)
    assert r.status_code == 400
    assert "incrementalSnapshotMetadata must be omitted for SNAPSHOT_TYPE_FULL" in r.json()["message"]


def test_incremental_without_metadata_is_invalid(client):
    r = post(client, "/hotLoads", {**GOOD_HOT_LOAD, "type": "SNAPSHOT_TYPE_INCREMENTAL"})
    assert r.status_code == 400
    assert "incrementalSnapshotMetadata is required for SNAPSHOT_TYPE_INCREMENTAL" in r.json()["message"]


def test_delta_on_itself_is_invalid(client):
    body = {
        **GOOD_HOT_LOAD,
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "step-1"},
    }
    r = post(client, "/hotLoads", body)
    assert r.status_code == 400 and "its own previousSnapshotIdentity" in r.json()["message"]


def test_unsupported_checksum_is_refused(client):
    body = {
        **GOOD_HOT_LOAD,
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "s0", "checksumFormat": "CHECKSUM_FORMAT_XXH3_128"},
    }
    r = post(client, "/hotLoads", body)
    assert r.status_code == 400
    assert "checksumFormat" in r.json()["message"] and "CHECKSUM_FORMAT_ADLER32" in r.json()["message"]


@pytest.mark.parametrize("hot_load_id", ["a/b", "../x", "", "x" * 129, "-lead"])
def test_bad_client_chosen_hot_load_id(client, hot_load_id):
    r = post(client, "/hotLoads", {**GOOD_HOT_LOAD, "hotLoadId": hot_load_id})
    assert r.status_code == 400 and "hotLoadId" in r.json()["message"]


def test_update_body_is_validated_strictly(client):
    r = client.patch(
        f"{PREFIX}/deployments/d1",
        json={"hotLoad": {"bucket": "bkt"}, "replicas": 3},
        headers={"Authorization": "Bearer admin-t"},
    )
    assert r.status_code == 400 and "replicas: unknown field" in r.json()["message"]


def test_engine_config_is_an_allow_list(client):
    body = deployment_body(engine_config={"host": "0.0.0.0"})
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and "'host'" in r.json()["message"] and "runtime.engineConfig" in r.json()["message"]
    body["runtime"]["engineConfig"] = {"max-model-len": "lots"}
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and "max-model-len must be a positive integer" in r.json()["message"]
    body["runtime"]["engineConfig"] = {"attention-backend": "--trust-remote-code"}
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and "attention-backend must be one of vLLM's names" in r.json()["message"]


@pytest.mark.parametrize("weight", [-1, 101, "50", 12.5, True])
def test_traffic_weight_is_an_integer_from_0_to_100(client, weight):
    body = deployment_body(traffic={"weight": weight})
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    assert "traffic.weight" in r.json()["message"], r.text
    r = client.patch(
        f"{PREFIX}/deployments/d1",
        json={"traffic": {"weight": weight}, "hotLoad": {"bucket": "bkt"}},
        headers={"Authorization": "Bearer admin-t"},
    )
    assert r.status_code == 400 and "traffic.weight" in r.json()["message"], r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("maxConcurrentSwaps", 0),
        ("maxConcurrentSwaps", 257),
        ("maxConcurrentSwaps", "2"),
        ("peerFanOut", 0),
        ("peerFanOut", 65),
        ("peerFanOut", 1.5),
        ("replicasPerGroup", 1),
        ("replicasPerGroup", 1001),
        ("replicasPerGroup", True),
    ],
)
def test_large_deployment_settings_are_bounded_integers(client, field, value):
    body = deployment_body(hotLoad={"bucket": "bkt", field: value})
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    assert f"hotLoad.{field}" in r.json()["message"], r.text


def test_an_operator_may_let_vllm_hot_load_and_nothing_unknown(monkeypatch, tmp_path):
    settings = Settings.create(tmp_path, 30000)  # owned: the variable is still this process's
    monkeypatch.setenv("ROLLOUTS_HOT_LOAD_ENGINES", "dynamo-vllm,vllm")
    assert settings.hot_load_engines == ("dynamo-vllm", "vllm")
    assert allowed_hot_load_engines(settings) == ("dynamo-vllm", "vllm")
    monkeypatch.setenv("ROLLOUTS_HOT_LOAD_ENGINES", "dynamo-vllm,sglang")
    with pytest.raises(SystemExit, match="ROLLOUTS_HOT_LOAD_ENGINES: sglang is not an engine"):
        allowed_hot_load_engines(settings)
    with pytest.raises(SystemExit, match="ROLLOUTS_HOT_LOAD_ENGINES: sglang is not an engine"):
        create_app(settings, temporal_client=NoTemporal())
    monkeypatch.setenv("ROLLOUTS_HOT_LOAD_ENGINES", "  ")
    assert settings.hot_load_engines is None
    monkeypatch.delenv("ROLLOUTS_HOT_LOAD_ENGINES")
    assert settings.hot_load_engines is None
    assert allowed_hot_load_engines(settings) == ("dynamo-vllm",)


def test_tensor_parallel_is_accepted_and_the_gpus_must_fit_it(client):
    body = deployment_body(
        engine_config={"tensor-parallel-size": "2"}, resources={"instanceType": "gpu", "gpuCount": 3}
    )
    r = post(client, "/deployments", body)
    assert r.status_code == 400, r.text
    assert (
        "resources.gpuCount (3) must be a multiple of runtime.engineConfig tensor-parallel-size (2)"
        in r.json()["message"]
    )
    body["runtime"]["engineConfig"]["tensor-parallel-size"] = "0"
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and "tensor-parallel-size must be a positive integer" in r.json()["message"]
    r = client.get(f"{PREFIX}/deployments/parameters", headers={"Authorization": "Bearer admin-t"})
    keys = r.json()["engineConfigKeys"]
    assert "tensor-parallel-size" in keys and "enable-expert-parallel" in keys


@pytest.mark.parametrize(
    ("tp", "gpus", "why"),
    [
        (
            "1",
            2,
            "enable-expert-parallel splits the experts over the tensor-parallel ranks: it needs "
            "tensor-parallel-size 2 or more",
        ),
        ("2", 0, r"enable-expert-parallel needs GPU replicas \(resources.gpuCount > 0\)"),
    ],
)
def test_expert_parallel_needs_tensor_parallel_ranks_on_gpus(client, tp, gpus, why):
    body = deployment_body(
        engine_config={"tensor-parallel-size": tp, "enable-expert-parallel": ""},
        resources={"instanceType": "gpu" if gpus else "cpu", "gpuCount": gpus},
    )
    r = post(client, "/deployments", body)
    assert r.status_code == 400 and re.search(why, r.json()["message"]), r.text


def test_expert_parallel_at_two_gpu_ranks_fits_and_takes_no_value():
    runtime = Runtime(engine="dynamo-vllm", engine_config={"tensor-parallel-size": "2", "enable-expert-parallel": ""})
    assert engine_config_problem(runtime, Resources(instance_type="gpu", gpu_count=2)) is None
    assert engine_config_problem(runtime, Resources(instance_type="gpu", gpu_count=4)) is None
    with pytest.raises(ValueError, match="enable-expert-parallel takes an empty value"):
        RuntimeIn(engine="dynamo-vllm", engine_config={"enable-expert-parallel": "true"})
