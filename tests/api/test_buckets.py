"""Bucket and path rules, and per-organization grants (common/buckets.py), on the API without
Temporal: a malformed `model`/`hotLoad` bucket or path is invalid_argument (400) and one the
organization is not granted is permission_denied (403), each naming the field, before anything
reaches Temporal."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import PREFIX, create_app
from common.buckets import Grant, bucket_problem, grant_problem, path_problem
from common.settings import Settings
from contracts.tokens import add_token
from tests.helpers.no_temporal import NoTemporal


@pytest.mark.parametrize(
    "value, words",
    [
        ("../models/base", "'..'"),
        ("/etc/passwd", "leading '/'"),
        ("s3://other-bucket/x", "not a URL"),
        ("models/../../etc", "'..'"),
        ("models/./base", "'.'"),
        ("a//b", "empty segment"),
        ("a\\b", "backslash"),
        ("a\nb", "control"),
    ],
)
def test_bad_paths_are_named(value, words):
    problem = path_problem(value, "model.path", allow_empty=False)
    assert problem is not None and problem.startswith("model.path") and words in problem


def test_good_paths_pass():
    for value in ("models/base", "models/base/", "checkpoints/policy", "a.b/c-d_e"):
        assert path_problem(value, "model.path", allow_empty=False) is None
    assert path_problem("", "hotLoad.pathPrefix", allow_empty=True) is None
    assert "empty" in path_problem("", "model.path", allow_empty=False)


@pytest.mark.parametrize("value", ["../x", "ab", "UPPER", "a..b", "-ab", "ab-", "a_b", "x" * 64, "s3://b"])
def test_bad_buckets(value):
    assert bucket_problem(value, "model.bucket")


def test_grants_cover_whole_segments():
    whole, prefixed = Grant.parse("rollouts"), Grant.parse("shared/team-b/")
    assert str(prefixed) == "shared/team-b" and prefixed.prefix == "team-b"
    assert whole.covers("rollouts", "") and whole.covers("rollouts", "any/thing")
    assert prefixed.covers("shared", "team-b") and prefixed.covers("shared", "team-b/ckpt")
    assert not prefixed.covers("shared", "team-b2/ckpt") and not prefixed.covers("shared", "")
    assert not whole.covers("other", "x")
    with pytest.raises(ValueError, match="bucket"):
        Grant.parse("../x")
    with pytest.raises(ValueError, match="'..'"):
        Grant.parse("shared/../x")


def test_grant_problem_names_the_field():
    grants = (Grant.parse("rollouts"), Grant.parse("shared/team-b"))
    assert grant_problem(grants, "org-a", "model.bucket", "rollouts", "model.path", "models/base") is None
    no_bucket = grant_problem(grants, "org-a", "hotLoad.bucket", "other", "hotLoad.pathPrefix", "x")
    assert no_bucket.startswith("hotLoad.bucket:") and "'other'" in no_bucket and "org-a" in no_bucket
    outside = grant_problem(grants, "org-a", "model.bucket", "shared", "model.path", "team-c/m")
    assert outside.startswith("model.path:") and "'team-b'" in outside


# ---------------------------------------------------------------------- through the API
@pytest.fixture()
def client(tmp_path):
    settings = Settings.create(tmp_path, 30000)
    add_token(settings.tokens_file, "admin-t", "admin", "org-a", "admin", buckets=["rollouts", "shared/team-a"])
    with TestClient(create_app(settings, temporal_client=NoTemporal())) as c:
        yield c


BODY = {
    "name": "d",
    "gatewayIds": ["gw"],
    "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
    "model": {"name": "m", "bucket": "rollouts", "path": "models/base"},
    "hotLoad": {"bucket": "rollouts", "pathPrefix": "ckpt"},
}


def create(client, *, model=None, hot_load=None):
    body = {**BODY, "model": {**BODY["model"], **(model or {})}, "hotLoad": {**BODY["hotLoad"], **(hot_load or {})}}
    return client.post(f"{PREFIX}/deployments", json=body, headers={"Authorization": "Bearer admin-t"})


@pytest.mark.parametrize(
    "model, hot_load, field",
    [
        ({"path": "../models/base"}, None, "model.path"),
        ({"path": "/etc/passwd"}, None, "model.path"),
        ({"path": "s3://other-bucket/x"}, None, "model.path"),
        ({"path": "models/../../etc"}, None, "model.path"),
        ({"bucket": "../x"}, None, "model.bucket"),
        (None, {"pathPrefix": "/abs"}, "hotLoad.pathPrefix"),
        (None, {"pathPrefix": "s3://other-bucket/x"}, "hotLoad.pathPrefix"),
        (None, {"bucket": "../x"}, "hotLoad.bucket"),
    ],
)
def test_malformed_is_invalid_argument_naming_the_field(client, model, hot_load, field):
    r = create(client, model=model, hot_load=hot_load)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and r.json()["message"].startswith(field + ":")


@pytest.mark.parametrize(
    "model, hot_load, field",
    [
        ({"bucket": "other-bucket"}, None, "model.bucket"),
        (None, {"bucket": "other-bucket"}, "hotLoad.bucket"),
        ({"bucket": "shared", "path": "team-b/base"}, None, "model.path"),
        (None, {"bucket": "shared", "pathPrefix": "team-a2"}, "hotLoad.pathPrefix"),
    ],
)
def test_not_granted_is_permission_denied_naming_the_field(client, model, hot_load, field):
    r = create(client, model=model, hot_load=hot_load)
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "permission_denied" and r.json()["message"].startswith(field + ":")
    assert "org-a" in r.json()["message"]
