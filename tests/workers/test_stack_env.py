"""A stack started in a shell that holds another stack's variables (workers/stack.py): `up`'s
settings are its home's, and every process it starts gets its home's environment. No process
starts here; tests/workers/test_stack.py starts a real stack in such a shell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.settings import STACK_ENV, Settings, without_stack_env
from tests.helpers.other_stack import other_stack_env
from workers.stack import SERVICE_ORDER, Stack, load_or_create_settings


@pytest.fixture
def other_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name in set(os.environ) - set(without_stack_env(os.environ)):
        monkeypatch.delenv(name)
    other = other_stack_env(tmp_path)
    del other["ROLLOUTS_HOST"], other["ROLLOUTS_DYNAMO_ROUTER_MODE"]  # `up`'s own inputs (below)
    for name, value in other.items():
        monkeypatch.setenv(name, value)
    return other


def test_up_takes_its_homes_addresses(tmp_path: Path, other_shell: dict[str, str]) -> None:
    fresh = load_or_create_settings(tmp_path / "home", 23000)
    fresh.save()
    again = load_or_create_settings(tmp_path / "home", None)
    for settings in (fresh, again):
        assert settings.owned
        assert (settings.api_url, settings.temporal_address, settings.s3_endpoint, settings.dynamo_frontend_url) == (
            "http://127.0.0.1:23000",
            "127.0.0.1:23010",
            "http://127.0.0.1:23020",
            "http://127.0.0.1:23002",
        )
        assert settings.tokens_file == tmp_path / "home" / "tokens.json"
    assert Settings.load(tmp_path / "home").api_url == other_shell["ROLLOUTS_API_URL"]  # a client's


def test_up_still_takes_its_host_and_router_mode_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTS_HOST", "10.1.2.3")
    monkeypatch.setenv("ROLLOUTS_DYNAMO_ROUTER_MODE", "kv")
    settings = load_or_create_settings(tmp_path / "home", 23000)
    assert (settings.host, settings.dynamo_router_mode) == ("10.1.2.3", "kv")
    settings.save()
    monkeypatch.delenv("ROLLOUTS_HOST")
    monkeypatch.delenv("ROLLOUTS_DYNAMO_ROUTER_MODE")
    recorded = load_or_create_settings(tmp_path / "home", None)
    assert (recorded.host, recorded.dynamo_router_mode) == ("10.1.2.3", "kv")


def test_every_service_gets_its_homes_environment(tmp_path: Path, other_shell: dict[str, str]) -> None:
    stack = Stack(load_or_create_settings(tmp_path / "home", 23000))
    for name in SERVICE_ORDER:
        env = stack._env(name)
        leaked = {k for k in env if k in STACK_ENV or k.startswith(("TEMPORAL_", "AWS_", "CW_"))} - {"ROLLOUTS_HOME"}
        assert not leaked, (name, leaked)
        assert env["ROLLOUTS_HOME"] == str(tmp_path / "home"), name
    dynamo = stack._env("dynamo")
    assert dynamo["DYN_FILE_KV"] == str(tmp_path / "home" / "dynamo" / "discovery")
    assert dynamo["DYN_DISCOVERY_BACKEND"] == "file"


def test_a_stack_refuses_a_clients_settings(tmp_path: Path) -> None:
    Settings.create(tmp_path, 23000).save()
    with pytest.raises(ValueError, match="settings.owned is False"):
        Stack(Settings.load(tmp_path))
