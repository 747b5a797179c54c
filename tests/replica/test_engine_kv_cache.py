"""A CPU engine's KV cache size (replica/agent/engine_process.py `kv_cache_args`): vLLM's
``--kv-cache-memory-bytes`` from ``ROLLOUTS_CPU_KV_CACHE_BYTES``, or the deployment's own
``kv-cache-memory-bytes``, which vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` no longer overrides
(its CPU platform reads the variable after the flags). The engine's own report of the size it
allocated: tests/replica/test_engine.py."""

from __future__ import annotations

from pathlib import Path

from common import envs
from replica.agent import engine_process
from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_process import KV_CACHE_FLAG, EngineProcess
from replica.agent.process import engine_options


def sizes(command: list[str]) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == KV_CACHE_FLAG]


def test_a_cpu_engine_gets_the_setting_or_the_deployments_own_size(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_process, "cpu_build", lambda: True)
    monkeypatch.setenv(envs.ROLLOUTS_CPU_KV_CACHE_BYTES.name, str(64 << 20))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    plain = EngineProcess(tmp_path / "m", work_dir=tmp_path / "w", port=41234)
    assert sizes(plain.command()) == [str(64 << 20)]
    assert "VLLM_CPU_KVCACHE_SPACE" not in plain.environment()
    own = engine_options({"kv-cache-memory-bytes": str(3 << 30)})
    server = EngineProcess(tmp_path / "m", work_dir=tmp_path / "w", port=41234, **own)
    worker = DynamoEngineProcess(
        tmp_path / "m", work_dir=tmp_path / "w", port=41234, discovery_dir=tmp_path / "d", namespace="n", **own
    )
    assert sizes(server.command()) == sizes(worker.command()) == [str(3 << 30)]
    monkeypatch.setattr(engine_process, "cpu_build", lambda: False)  # a GPU build: vLLM sizes it
    assert sizes(EngineProcess(tmp_path / "m", work_dir=tmp_path / "w", port=41234).command()) == []
