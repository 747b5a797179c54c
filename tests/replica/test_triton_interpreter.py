"""Routed experts on vLLM's CPU build (replica/engine/triton_interpreter, replica/agent/engine_process.py):
an engine started with ``--enable-return-routed-experts`` gets Model Runner V2 with Triton's
interpreter, and only that engine; in a process with that environment vLLM's CPU build accepts
Triton, which Model Runner V2 needs (without it, it does not). The engine itself, returning routes after
hot-loads: tests/e2e/test_model_families.py (Qwen3-MoE at TP 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from replica.agent import engine_process
from replica.agent.engine_process import EngineProcess
from replica.launch import ROUTED_EXPERTS_FLAG, TRITON_INTERPRETER_DIR

INTERPRETED = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def env_of(tmp_path: Path, *extra_args: str) -> dict[str, str]:
    return EngineProcess(tmp_path / "model", work_dir=tmp_path / "work", port=41234,
                         extra_args=list(extra_args)).environment()


def test_only_a_cpu_engine_that_returns_routes_runs_triton_interpreted(tmp_path: Path, monkeypatch) -> None:
    for name in INTERPRETED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine_process, "cpu_build", lambda: True)
    env = env_of(tmp_path, ROUTED_EXPERTS_FLAG)
    assert {k: env.get(k) for k in INTERPRETED} == INTERPRETED
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(TRITON_INTERPRETER_DIR)
    assert (TRITON_INTERPRETER_DIR / "sitecustomize.py").is_file()
    plain = env_of(tmp_path, "--max-num-batched-tokens", "512")
    assert not INTERPRETED.keys() & plain.keys() and str(TRITON_INTERPRETER_DIR) not in plain["PYTHONPATH"]
    monkeypatch.setattr(engine_process, "cpu_build", lambda: False)  # a GPU build runs V2 with Triton itself
    gpu = env_of(tmp_path, ROUTED_EXPERTS_FLAG)
    assert not INTERPRETED.keys() & gpu.keys() and str(TRITON_INTERPRETER_DIR) not in gpu["PYTHONPATH"]


_RESOLVE = "from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)"


@pytest.mark.skipif(not engine_process.cpu_build(), reason="the interpreter is for vLLM's CPU build")
def test_in_that_environment_vllms_cpu_build_accepts_triton(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k not in INTERPRETED and k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", _RESOLVE], env=base, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.split()[-1] == "False"  # the premise: without it, no Triton, hence no V2 runner
    env = env_of(tmp_path, ROUTED_EXPERTS_FLAG)
    interpreted = subprocess.run([sys.executable, "-c", _RESOLVE], capture_output=True, text=True, timeout=120,
                                 env={**base, **{k: env[k] for k in (*INTERPRETED, "PYTHONPATH")}})
    assert interpreted.returncode == 0, interpreted.stderr[-2000:]
    assert interpreted.stdout.split()[-1] == "True"
