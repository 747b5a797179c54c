"""A Dynamo worker's discovery settings (``replica.agent.dynamo.DynamoEngineProcess``), unit: the
``file`` backend registers in the shared directory, the ``kubernetes`` backend in the pod's
namespace and refuses to start without the pod's downward-API variables; an unknown backend is
refused by name; the worker stops after a 1 s grace (Dynamo's default 5 s) unless the operator set
one. No process starts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from replica.agent.dynamo import GRACE_ENV, STOP_GRACE_S, DynamoEngineProcess
from replica.agent.engine_process import EngineStartError


def worker(tmp_path: Path, backend: str) -> DynamoEngineProcess:
    return DynamoEngineProcess(
        tmp_path / "model",
        work_dir=tmp_path / "work",
        discovery_dir=tmp_path / "discovery",
        namespace="ns",
        served_model_name="m",
        discovery_backend=backend,
        secret="s",
    )


def test_file_discovery_registers_in_the_shared_directory(tmp_path: Path) -> None:
    w = worker(tmp_path, "file")
    w.port = 20000
    command, env = w.command(), w.environment()
    assert command[command.index("--discovery-backend") + 1] == "file"
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"] == str(tmp_path / "discovery")


def test_kubernetes_discovery_needs_the_pod_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_FILE_KV", "/somewhere/else")  # not passed on: this backend has no directory
    for name in ("POD_NAME", "POD_NAMESPACE", "POD_UID"):
        monkeypatch.delenv(name, raising=False)
    w = worker(tmp_path, "kubernetes")
    w.port = 20000
    command, env = w.command(), w.environment()
    assert command[command.index("--discovery-backend") + 1] == "kubernetes"
    assert env["DYN_DISCOVERY_BACKEND"] == "kubernetes" and "DYN_FILE_KV" not in env
    monkeypatch.setenv("POD_NAME", "rollouts-node-x")
    with pytest.raises(EngineStartError, match="POD_NAMESPACE, POD_UID are not set"):
        asyncio.run(w.start())
    assert not (tmp_path / "discovery").exists() and w.pid is None


def test_an_unknown_backend_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="discovery_backend: 'etcd' is not one of file, kubernetes"):
        worker(tmp_path, "etcd")


def test_the_worker_stops_after_a_one_second_grace_unless_the_operator_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(GRACE_ENV, raising=False)
    w = worker(tmp_path, "file")
    w.port = 20000
    assert w.environment()[GRACE_ENV] == str(STOP_GRACE_S) == "1"  # Dynamo's own default: 5 s
    monkeypatch.setenv(GRACE_ENV, "7")
    assert w.environment()[GRACE_ENV] == "7"
