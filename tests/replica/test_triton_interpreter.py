"""Routed experts on vLLM's CPU build (replica/engine/triton_interpreter, replica/agent/engine_process.py):
an engine started with ``--enable-return-routed-experts`` gets Model Runner V2 with Triton's
interpreter, and only that engine; in that environment Triton has the inactive ``cpu`` entry vLLM
looks for, and the environment's own ``sitecustomize`` still runs. The engine itself (which without that environment
refuses to start: docs/field-notes.md), returning routes after hot-loads: tests/e2e/test_model_families.py
(Qwen3-MoE at TP 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from replica.agent import engine_process
from replica.agent.engine_process import EngineProcess
from replica.launch import ROUTED_EXPERTS_FLAG, TRITON_INTERPRETER_DIR

INTERPRETED = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def env_of(tmp_path: Path, *extra_args: str) -> dict[str, str]:
    return EngineProcess(
        tmp_path / "model", work_dir=tmp_path / "work", port=41234, extra_args=list(extra_args)
    ).environment()


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


def test_the_interpreters_sitecustomize_registers_the_entry_and_runs_the_next_one(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    probe = (
        "import builtins, triton.backends as b; "
        "print(getattr(builtins, 'THEIRS_RAN', False), 'cpu' in b.backends, b.backends['cpu'].driver.is_active())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(TRITON_INTERPRETER_DIR), str(theirs)))}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "False"]
