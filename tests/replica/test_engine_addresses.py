"""Where a replica's engine binds, where its agent drives it, and the URL other hosts get
(replica/agent/engine_process.py), without starting an engine: the command line, the environment and
the URLs of EngineProcess objects, and a start refused on an address that does not resolve
(looked up in a network namespace with no interface up: tests/helpers/no_network.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.addresses import AddressError
from replica.agent import engine_process
from replica.agent.engine_process import EngineProcess
from replica.launch import NODE_ADDRESS_ENV
from tests.helpers.no_network import python_without_network


def engine(tmp_path: Path, **kwargs: object) -> EngineProcess:
    e = EngineProcess(tmp_path / "model", work_dir=tmp_path / "work", port=41234, **kwargs)
    e._proc = object()  # type: ignore[assignment] # stands for a started server: public_url needs one
    return e


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_by_default_everything_is_loopback(tmp_path: Path) -> None:
    e = engine(tmp_path)
    assert flag(e.command(), "--host") == "127.0.0.1"
    assert e.control_host == "127.0.0.1"
    assert e.public_url == "http://127.0.0.1:41234"
    assert e.environment()[NODE_ADDRESS_ENV] == "127.0.0.1"


def test_a_wildcard_bind_is_driven_over_loopback_and_published_at_the_node_address(tmp_path: Path) -> None:
    e = engine(tmp_path, host="0.0.0.0", node_address="10.40.0.2")
    assert flag(e.command(), "--host") == "0.0.0.0"
    assert e.control_host == "127.0.0.1"  # the guard's own-host rule lets the agent in
    assert e.public_url == "http://10.40.0.2:41234"  # what the gateway routes to
    env = e.environment()
    assert env[NODE_ADDRESS_ENV] == "10.40.0.2"  # the engine's gloo device binds it
    assert env["FORWARDED_ALLOW_IPS"] == "127.0.0.1,::1"
    assert engine(tmp_path, host="::", node_address="fd00::2").public_url == "http://[fd00::2]:41234"
    assert engine(tmp_path, host="::", node_address="fd00::2").control_host == "::1"


def test_one_specific_bind_address_is_driven_there(tmp_path: Path) -> None:
    e = engine(tmp_path, host="10.40.0.2")
    assert e.control_host == "10.40.0.2" and e.node_address == "10.40.0.2"
    assert e.public_url == "http://10.40.0.2:41234"


def test_nccl_gets_the_interface_holding_the_node_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    # Loopback: nothing to choose (NCCL's own default).
    assert "NCCL_SOCKET_IFNAME" not in engine(tmp_path, host="0.0.0.0", node_address="127.0.0.1").environment()
    # An address no local interface holds (TEST-NET-3): left unset, not guessed.
    assert "NCCL_SOCKET_IFNAME" not in engine(tmp_path, host="0.0.0.0", node_address="203.0.113.77").environment()
    # An operator's choice is kept.
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert engine(tmp_path, host="0.0.0.0", node_address="203.0.113.77").environment()["NCCL_SOCKET_IFNAME"] == "ib0"


async def test_a_wildcard_node_address_is_refused(tmp_path: Path) -> None:
    e = EngineProcess(tmp_path / "model", work_dir=tmp_path / "work", host="0.0.0.0", node_address="0.0.0.0")
    with pytest.raises(AddressError, match="wildcard"):
        await e.start(timeout=1)
    assert e.pid is None
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("which", ["host", "node_address"])
def test_a_bind_or_node_address_that_does_not_resolve_is_refused_before_the_start(tmp_path: Path, which: str) -> None:
    code = (
        "import asyncio, sys; from replica.agent.engine_process import EngineProcess\n"
        f"e = EngineProcess('m', work_dir={str(tmp_path / 'work')!r}, **{{{which!r}: 'no.such.host.invalid'}})\n"
        "try:\n    asyncio.run(e.start(timeout=1))\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = python_without_network(code)
    assert out.startswith("AddressError") and "'no.such.host.invalid' does not resolve" in out, out
    assert ("--engine-bind" if which == "host" else "--node-address") in out
    assert not (tmp_path / "work").exists()  # nothing started


def test_cpu_threads_are_unbound_unless_the_ranks_are_given_their_cores(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_process, "cpu_build", lambda: True)
    env = engine(tmp_path).environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) - 1))  # as many as vLLM's "auto" gives
    ranks = engine(tmp_path, ranks=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert ranks.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_a_cuda_build_keeps_vllms_own_threads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_process, "cpu_build", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = engine(tmp_path).environment()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # CUDA runs a one-rank worker in the engine core itself


def test_a_one_rank_cpu_engine_runs_its_worker_in_the_engine_core(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_process, "cpu_build", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert engine(tmp_path).environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # Tensor parallel: one worker process per rank (vLLM's multiprocess executor needs it).
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine(tmp_path, ranks=2).environment()
