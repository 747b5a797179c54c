"""One engine cache for the whole test session (``ROLLOUTS_ENGINE_CACHE_DIR``,
``common.settings.ENGINE_CACHE_ENV``): every stack's replica agents, the multi-host tests' hosts
and the engines tests start themselves share vLLM's record of each model class, so only the
first engine of each architecture in the session inspects its class in a child process that
imports vLLM again (about 7 s of a core each: docs/field-notes.md).

The controller (or the one process without xdist) makes the directory before any worker starts;
the workers inherit the variable. A value the shell already set is used as it is and kept. A
session of xdist workers that may start engines (`make test`, not `make test-fast`) also writes
the records of every architecture the suite serves there at once, in one background process
(`tests.helpers.inspect_models`: one vLLM import for all of them, not one per architecture),
stopped at the session's end if it still runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.processes import stop_pid
from common.settings import ENGINE_CACHE_ENV
from replica.agent.engine_process import share_model_infos

_MADE = "ROLLOUTS_TEST_ENGINE_CACHE_MADE"  # set when this session made the directory


_inspecting: subprocess.Popen[bytes] | None = None


def share_engine_cache(engines: bool) -> None:
    """``engines``: the session may start engines, so the architectures' records are written now."""
    if os.environ.get(ENGINE_CACHE_ENV):
        return
    os.environ[ENGINE_CACHE_ENV] = tempfile.mkdtemp(prefix="rollouts-engine-cache-")
    os.environ[_MADE] = "1"
    if engines:
        global _inspecting
        _inspecting = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.inspect_models", os.environ[ENGINE_CACHE_ENV]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def forget_engine_cache() -> None:
    global _inspecting
    if _inspecting is not None:
        stop_pid(_inspecting.pid, timeout=5, group=False)
        _inspecting.wait()
        _inspecting = None
    if os.environ.pop(_MADE, None):
        shutil.rmtree(os.environ.pop(ENGINE_CACHE_ENV), ignore_errors=True)


def model_infos() -> Path | None:
    """Where an engine a test starts keeps vLLM's model-class records (``EngineProcess``'s
    ``model_info_cache``); None outside a test session that shares one."""
    value = os.environ.get(ENGINE_CACHE_ENV)
    return Path(value) / "modelinfos" if value else None


def vllm_process_env(scratch: Path) -> dict[str, str]:
    """The environment of a test's own vLLM process (a model built in it, no engine server):
    vLLM's cache root in ``scratch``, its model-class records the session's (else vLLM inspects
    each architecture in a child process that imports vLLM again)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(scratch)}
    if (shared := model_infos()) is not None:
        share_model_infos(shared, scratch / "modelinfos")
    return env
