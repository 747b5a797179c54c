"""Settings (common/settings.py): the host every URL names, the environment's overrides, and the
settings of a cluster install built from the environment alone (no stack.json).

No traffic: nothing here resolves or contacts an address."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import common.settings as settings_module
from common.settings import DEFAULT_PORT_BASE, ENV_FIELDS, HOST_ENV, PORT_ENVS, REQUIRED_ENV, Settings

# Every variable the settings read, cleared for each test so the runner's shell cannot leak in.
ALL_ENV = (
    "ROLLOUTS_HOME",
    "TEMPORAL_ADDRESS",
    "TEMPORAL_NAMESPACE",
    "TEMPORAL_UI_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "ROLLOUTS_TOKENS_FILE",
    "ROLLOUTS_ENGINE_KEY",
    "ROLLOUTS_API_URL",
    "ROLLOUTS_GATEWAY_URL",
    "ROLLOUTS_HOST",
    "ROLLOUTS_API_PORT",
    "ROLLOUTS_GATEWAY_PORT",
    "ROLLOUTS_DYNAMO_ROUTER_MODE",
    "ROLLOUTS_DYNAMO_FRONTEND_URL",
    "ROLLOUTS_DYNAMO_DISCOVERY_DIR",
    "ROLLOUTS_DYNAMO_TLS_DIR",
    "ROLLOUTS_DYNAMO_EVENT_BROKER",
    "ROLLOUTS_DYNAMO_DISCOVERY",
    "ROLLOUTS_WORKER_METRICS_PORT",
    "ROLLOUTS_REPLICA_METRICS_PORT",
    "ROLLOUTS_NODE_LOST_AFTER_S",
    "ROLLOUTS_HOT_LOAD_ENGINES",
    "ROLLOUTS_ENGINE_CACHE_DIR",
    *(f"ROLLOUTS_{name.upper()}" for name in ENV_FIELDS),
)

CLUSTER_ENV = {
    "TEMPORAL_ADDRESS": "temporal.rollouts.svc:7233",
    "AWS_ENDPOINT_URL_S3": "http://10.20.0.9:9000",
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "secret-example",
    "ROLLOUTS_ENGINE_KEY": "engine-key-example",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_module_docstring_names_every_variable_it_reads() -> None:
    source = Path(settings_module.__file__).read_text()
    # Variables read by name, and those read through the module's tables.
    read = {a or b for a, b in re.findall(r'(?:environ|env)\.get\("([A-Z0-9_]+)"\)|env\["([A-Z0-9_]+)"\]', source)}
    read |= set(re.findall(r"envs\.(ROLLOUTS_[A-Z0-9_]+)\.get\(", source))  # through common/envs.py
    read |= {HOST_ENV, *PORT_ENVS.values(), *REQUIRED_ENV, *(f"ROLLOUTS_{name.upper()}" for name in ENV_FIELDS)}
    assert {"TEMPORAL_ADDRESS", "ROLLOUTS_HOST", "ROLLOUTS_API_PORT", "ROLLOUTS_ENGINE_KEY", "ROLLOUTS_BUCKET"} <= read
    assert read <= set(ALL_ENV), read - set(ALL_ENV)  # this test clears all of them
    for name in read:
        assert f"``{name}``" in (settings_module.__doc__ or ""), name


def test_every_url_names_the_host(tmp_path: Path) -> None:
    settings = Settings.create(tmp_path, 17000, host="10.1.2.3")
    assert settings.temporal_address == "10.1.2.3:17010"
    assert settings.temporal_ui_url == "http://10.1.2.3:17011"
    assert settings.s3_endpoint == "http://10.1.2.3:17020"
    assert settings.api_url == "http://10.1.2.3:17000"
    assert settings.gateway_url == "http://10.1.2.3:17001"
    assert Settings.create(tmp_path, 17000, host="fd00::5").api_url == "http://[fd00::5]:17000"
    # The default stays loopback, as `make demo` and `make test` expect.
    assert Settings.create(tmp_path).api_url == f"http://127.0.0.1:{DEFAULT_PORT_BASE}"


def test_stack_json_records_the_host_and_the_environment_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Settings.create(tmp_path, 17000, host="10.1.2.3").save()
    assert json.loads((tmp_path / "stack.json").read_text())["host"] == "10.1.2.3"
    assert Settings.load(tmp_path).host == "10.1.2.3"
    monkeypatch.setenv("ROLLOUTS_HOST", "10.9.9.9")
    monkeypatch.setenv("ROLLOUTS_API_PORT", "18080")
    monkeypatch.setenv("ROLLOUTS_GATEWAY_PORT", "18081")
    monkeypatch.setenv("ROLLOUTS_BUCKET", "other-bucket")
    settings = Settings.load(tmp_path)
    assert (settings.host, settings.ports["api"], settings.ports["gateway"]) == ("10.9.9.9", 18080, 18081)
    assert settings.api_url == "http://10.9.9.9:18080" and settings.gateway_url == "http://10.9.9.9:18081"
    assert settings.bucket == "other-bucket"
    assert settings.ports["temporal"] == 17010  # not overridden


def test_a_stack_json_from_before_0_1_0_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    data = json.loads(json.dumps(Settings.create(tmp_path).__dict__))
    (tmp_path / "stack.json").write_text(json.dumps(data))
    assert Settings.load(tmp_path).ports == data["ports"]  # the premise: as written, it loads
    del data["ports"]["dynamo"]
    data["dynamo"] = True  # when Dynamo was a switch of the stack's
    (tmp_path / "stack.json").write_text(json.dumps(data))
    with pytest.raises(
        SystemExit,
        match=r"stack.json was written before rollouts 0.1.0 \(ports missing: dynamo; "
        r"unknown keys: dynamo\)",
    ):
        Settings.load(tmp_path)


def test_dynamo_settings_from_stack_json_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(json.dumps(Settings.create(tmp_path, port_base=24000).__dict__))
    del data["dynamo_router_mode"]  # the default
    (tmp_path / "stack.json").write_text(json.dumps(data))
    loaded = Settings.load(tmp_path)
    assert loaded.dynamo_router_mode == "least-loaded"
    # The embedded stack runs the relay of Dynamo's event plane: every Dynamo process uses it.
    assert loaded.dynamo_event_broker == "xsub=tcp://127.0.0.1:24004 , xpub=tcp://127.0.0.1:24005"
    assert loaded.dynamo_frontend_url == "http://127.0.0.1:24002"
    assert loaded.dynamo_discovery_dir == tmp_path / "dynamo" / "discovery"
    assert loaded.stack_env()["ROLLOUTS_DYNAMO_FRONTEND_URL"] == "http://127.0.0.1:24002"
    monkeypatch.setenv("ROLLOUTS_DYNAMO_ROUTER_MODE", "kv")
    monkeypatch.setenv("ROLLOUTS_DYNAMO_DISCOVERY_DIR", "/shared/discovery")
    loaded = Settings.load(tmp_path)
    assert loaded.dynamo_router_mode == "kv" and loaded.dynamo_discovery_backend == "file"
    monkeypatch.setenv("ROLLOUTS_DYNAMO_DISCOVERY", "kubernetes")
    assert Settings.load(tmp_path).dynamo_discovery_backend == "kubernetes"
    monkeypatch.setenv("ROLLOUTS_DYNAMO_DISCOVERY", "etcd")
    with pytest.raises(SystemExit, match="ROLLOUTS_DYNAMO_DISCOVERY='etcd': not one of file, kubernetes"):
        Settings.load(tmp_path).dynamo_discovery_backend
    assert loaded.dynamo_discovery_dir == Path("/shared/discovery")
    assert loaded.stack_env()["ROLLOUTS_DYNAMO_FRONTEND_URL"] == "http://127.0.0.1:24002"
    monkeypatch.setenv("ROLLOUTS_DYNAMO_EVENT_BROKER", "xsub=tcp://10.0.0.1:1 , xpub=tcp://10.0.0.1:2")
    assert Settings.load(tmp_path).dynamo_event_broker == "xsub=tcp://10.0.0.1:1 , xpub=tcp://10.0.0.1:2"


def test_a_port_that_is_not_one_names_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Settings.create(tmp_path).save()
    for value in ("http", "0", "70000"):
        monkeypatch.setenv("ROLLOUTS_API_PORT", value)
        with pytest.raises(SystemExit, match=f"ROLLOUTS_API_PORT='{value}': not a TCP port"):
            Settings.load(tmp_path)


def test_without_stack_json_or_temporal_address_load_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="rollouts up") as err:
        Settings.load(tmp_path)
    assert "TEMPORAL_ADDRESS" in str(err.value)


def test_a_cluster_install_builds_the_settings_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in CLUSTER_ENV.items():
        monkeypatch.setenv(name, value)
    names = {f"ROLLOUTS_{name.upper()}": f"value-of-{name}" for name in ENV_FIELDS}
    for name, value in names.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ROLLOUTS_TOKENS_FILE", "/etc/rollouts/tokens.json")
    monkeypatch.setenv("ROLLOUTS_HOST", "0.0.0.0")
    monkeypatch.setenv("ROLLOUTS_API_PORT", "8080")
    monkeypatch.setenv("ROLLOUTS_API_URL", "http://api.rollouts.svc:8080")
    settings = Settings.load(tmp_path)
    assert not (tmp_path / "stack.json").exists()
    assert settings.temporal_address == "temporal.rollouts.svc:7233"
    assert settings.s3_endpoint == "http://10.20.0.9:9000"
    assert (settings.s3_access_key, settings.s3_secret_key) == ("AKIDEXAMPLE", "secret-example")
    assert settings.engine_key == "engine-key-example"
    assert settings.tokens_file == Path("/etc/rollouts/tokens.json")
    assert (settings.host, settings.ports["api"]) == ("0.0.0.0", 8080)
    assert settings.api_url == "http://api.rollouts.svc:8080"
    assert settings.dynamo_event_broker is None  # no relay unless the install names one: Dynamo's direct mode
    for name in ENV_FIELDS:
        assert getattr(settings, name) == f"value-of-{name}", name
    # Every process of the install derives the same engine secret from the shared key.
    other = Settings.from_env(tmp_path / "elsewhere")
    assert other.engine_secret("wf", "r0") == settings.engine_secret("wf", "r0")


def test_a_cluster_install_missing_variables_names_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal:7233")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    with pytest.raises(SystemExit) as err:
        Settings.load(tmp_path)
    missing_clause = str(err.value).split(" are not set")[0]
    named = set(re.findall(r"[A-Z][A-Z0-9_]+", missing_clause))
    assert named == set(REQUIRED_ENV) - {"TEMPORAL_ADDRESS", "AWS_ACCESS_KEY_ID"}, str(err.value)


def test_the_node_registrys_lost_after_is_read_by_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Settings.create(tmp_path, port_base=24000).save()
    monkeypatch.delenv("ROLLOUTS_NODE_LOST_AFTER_S", raising=False)
    assert Settings.load(tmp_path).node_lost_after_s is None  # the registry's default
    monkeypatch.setenv("ROLLOUTS_NODE_LOST_AFTER_S", "4.5")
    assert Settings.load(tmp_path).node_lost_after_s == 4.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("ROLLOUTS_NODE_LOST_AFTER_S", bad)
        with pytest.raises(ValueError, match="ROLLOUTS_NODE_LOST_AFTER_S"):
            _ = Settings.load(tmp_path).node_lost_after_s
