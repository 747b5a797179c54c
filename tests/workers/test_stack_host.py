"""The stack's host (workers/stack.py, workers/commands/api.py, gateway.py): an address that does
not resolve, the wildcard or a name is refused before anything starts or is written, and a
home's recorded host changes only while nothing runs. No service starts here; names are looked
up only in a network namespace with no interface up (tests/helpers/no_network.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from common.processes import PidFile
from common.settings import Settings
from tests.helpers.no_network import python_without_network, run_without_network
from workers.stack import Stack, StackError, load_or_create_settings

BAD_HOST = "no.such.host.invalid"


@pytest.fixture(autouse=True)
def no_host_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROLLOUTS_HOST", "TEMPORAL_ADDRESS", "ROLLOUTS_API_PORT", "ROLLOUTS_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_up_refuses_a_host_that_does_not_resolve_before_starting_anything(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code = (
        "import sys; from pathlib import Path; from common.settings import Settings\n"
        "from workers.stack import Stack, StackError\n"
        f"stack = Stack(Settings.create(Path({str(home)!r}), 17000, host={BAD_HOST!r}))\n"
        "try:\n    stack.up(say=print)\nexcept StackError as exc:\n    print('REFUSED', exc)\n"
    )
    out = python_without_network(code)
    assert out.startswith("REFUSED") and BAD_HOST in out and "does not resolve" in out, out
    assert "--host" in out and "ROLLOUTS_HOST" in out
    assert not home.exists()  # nothing written, nothing started


@pytest.mark.parametrize(("host", "reason"), [("0.0.0.0", "wildcard"), ("localhost", "is a name")])
def test_up_refuses_the_wildcard_and_names(tmp_path: Path, host: str, reason: str) -> None:
    stack = Stack(Settings.create(tmp_path / "home", 17000, host=host))
    with pytest.raises(StackError, match=reason) as err:
        stack.up(say=print)
    assert repr(host) in str(err.value)
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("service", ["api", "gateway"])
def test_a_service_refuses_a_host_that_does_not_resolve(tmp_path: Path, service: str) -> None:
    Settings.create(tmp_path, 17000).save()
    proc = run_without_network(
        [sys.executable, "-m", "workers.cli", service, "--home", str(tmp_path)], env={"ROLLOUTS_HOST": BAD_HOST}
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rollouts {service}: AddressError") and BAD_HOST in last and "ROLLOUTS_HOST" in last, last


def test_a_new_home_records_the_host_of_its_first_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_or_create_settings(tmp_path / "a", 17000, "10.1.2.3").host == "10.1.2.3"
    assert load_or_create_settings(tmp_path / "b", 17000).host == "127.0.0.1"
    monkeypatch.setenv("ROLLOUTS_HOST", "10.4.5.6")
    assert load_or_create_settings(tmp_path / "c", 17000).host == "10.4.5.6"
    assert load_or_create_settings(tmp_path / "d", 17000, "10.1.2.3").host == "10.1.2.3"  # the flag first


def test_another_host_on_an_existing_home_only_while_nothing_runs(tmp_path: Path) -> None:
    Settings.create(tmp_path, 17000, host="127.0.0.1").save()
    assert load_or_create_settings(tmp_path, None).host == "127.0.0.1"
    # Nothing runs: the new host is taken (and `up` saves it).
    assert load_or_create_settings(tmp_path, None, "10.1.2.3").host == "10.1.2.3"
    # A service runs (this test process stands in for it): a clear error, the record unchanged.
    PidFile(tmp_path / "pids" / "api.pid").write(os.getpid())
    with pytest.raises(StackError, match="rollouts down") as err:
        load_or_create_settings(tmp_path, None, "10.1.2.3")
    assert "127.0.0.1" in str(err.value) and "10.1.2.3" in str(err.value) and "api" in str(err.value)
    assert json.loads((tmp_path / "stack.json").read_text())["host"] == "127.0.0.1"
    assert load_or_create_settings(tmp_path, None, "127.0.0.1").host == "127.0.0.1"  # the same host is fine
