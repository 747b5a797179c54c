"""Another stack's environment (common/settings.py): a home's own settings (``Settings.own``,
``Settings.create``) and the environment of the processes its stack starts
(``Settings.process_env``) ignore another stack's variables, which a client's settings
(``Settings.load``) still honour.

No traffic: nothing here resolves or contacts an address."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import pytest

from common.settings import STACK_ENV, Settings, without_stack_env
from tests.helpers.other_stack import other_stack_env

# Unrelated variables a stack's processes must still inherit.
KEPT = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
    "ROLLOUTS_HOT_LOAD_ENGINES": "dynamo-vllm,vllm",
    "ROLLOUTS_TEST_SESSION": "s1",
    "CUDA_VISIBLE_DEVICES": "0",
    "ROLLOUTS_ENGINE_CACHE_DIR": "/var/cache/engines",
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A saved home on 127.0.0.1:21000..., in a shell holding another stack's variables."""
    for name in set(os.environ) - set(without_stack_env(os.environ)):
        monkeypatch.delenv(name)
    Settings.create(tmp_path / "home", 21000).save()
    for name, value in {**other_stack_env(tmp_path), **KEPT}.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "home"


def addresses(settings: Settings) -> tuple:
    return (
        settings.api_url,
        settings.gateway_url,
        settings.temporal_address,
        settings.temporal_namespace,
        settings.temporal_ui_url,
        settings.s3_endpoint,
        settings.dynamo_frontend_url,
        settings.dynamo_discovery_dir,
        settings.dynamo_discovery_backend,
        settings.dynamo_router_mode,
        settings.tokens_file,
        settings.bucket,
        settings.gateway_id,
        settings.engine_secret("wf", "r0"),
    )


def test_a_homes_own_settings_ignore_another_stacks_environment(home: Path) -> None:
    own = Settings.own(home)
    assert own.owned and not own.env
    assert not Settings(home=str(home), ports={}).owned  # any other is a client's
    key = own.engine_key.encode()
    assert addresses(own) == (
        "http://127.0.0.1:21000",
        "http://127.0.0.1:21001",
        "127.0.0.1:21010",
        "default",
        "http://127.0.0.1:21011",
        "http://127.0.0.1:21020",
        "http://127.0.0.1:21002",
        home / "dynamo" / "discovery",
        "file",
        "least-loaded",
        home / "tokens.json",
        "rollouts",
        "gw-local",
        hmac.new(key, b"wf\nr0", hashlib.sha256).hexdigest(),
    )
    s3 = own.s3_client()
    assert s3.meta.endpoint_url == "http://127.0.0.1:21020"
    assert s3._request_signer._credentials.access_key == own.s3_access_key
    assert s3.meta.region_name == own.s3_region
    # A new configuration is owned too: what `rollouts up`, the tests' and the benches' stacks use.
    assert Settings.create(home.parent / "fresh", 22000).api_url == "http://127.0.0.1:22000"


def test_a_client_still_reads_the_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_PROFILE")  # a client's boto3 honours it, and this machine has no such profile
    client = Settings.load(home)
    assert not client.owned
    assert client.api_url == os.environ["ROLLOUTS_API_URL"] == "http://10.9.9.9:18000"
    assert client.temporal_address == os.environ["TEMPORAL_ADDRESS"] == "10.9.9.9:18010"
    assert client.s3_endpoint == os.environ["AWS_ENDPOINT_URL_S3"]
    assert client.dynamo_frontend_url == os.environ["ROLLOUTS_DYNAMO_FRONTEND_URL"]
    assert (client.temporal_namespace, client.bucket, client.gateway_id) == ("other-ns", "other-bucket", "gw-other")
    assert client.tokens_file == Path("/other/tokens.json")
    assert client.s3_client()._request_signer._credentials.access_key == os.environ["AWS_ACCESS_KEY_ID"]
    assert addresses(client) != addresses(Settings.own(home))


def test_the_stacks_processes_get_their_homes_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = Settings.own(home)
    env = own.process_env()
    leaked = {k for k in env if k in STACK_ENV or k.startswith(("TEMPORAL_", "AWS_", "CW_"))} - {"ROLLOUTS_HOME"}
    assert not leaked, leaked
    assert env["ROLLOUTS_HOME"] == str(home)
    assert {k: env[k] for k in KEPT} == KEPT
    assert env["PATH"] == os.environ["PATH"]
    # A process started with it (the API, a replica agent...) loads its settings as a client does,
    # and gets the home's.
    monkeypatch.setattr(os, "environ", env)
    assert addresses(Settings.load(home)) == addresses(own)


def test_the_engine_cache_is_this_processs_own(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Set (KEPT): every home's settings, its own included, name that directory; unset: the home's.
    assert Settings.own(home).engine_cache_dir == Path("/var/cache/engines")
    monkeypatch.delenv("ROLLOUTS_ENGINE_CACHE_DIR")
    assert Settings.own(home).engine_cache_dir == home / "engine-cache"
