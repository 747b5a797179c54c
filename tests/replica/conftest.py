"""Fixtures for the replica tests: the generated models and ONE vLLM CPU engine per session.

A vLLM start is slow (timings: bench/README.md), so the replica tests share one engine and each
test puts the engine in the state it needs (tests/helpers/engine_weights.py loads a checkpoint).
``ROLLOUTS_TEST_ENGINE_URL=http://127.0.0.1:PORT`` reuses a running engine instead (development;
it must serve the base model as "base" with our extension and ``--max-model-len 2048``, and its
secret must be in ``ROLLOUTS_TEST_ENGINE_SECRET``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from replica.agent.engine_process import EngineProcess
from tests.helpers.engine_cache import model_infos
from workers.base_model import write_base_model, write_counting_model

SERVED_NAME = "base"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    base = write_base_model(root / "base")
    counting = write_counting_model(base, root / "counting")
    return {"base": base, "counting": counting}


async def _start_engine(model_dir: Path, work_dir: Path) -> EngineProcess:
    # max-model-len 2048: the in-flight test needs generations long enough to outlast the lag of
    # the server's streams behind the engine on a busy machine.
    engine = EngineProcess(
        model_dir, work_dir=work_dir, served_model_name=SERVED_NAME, max_model_len=2048, model_info_cache=model_infos()
    )
    await engine.start(timeout=600)
    return engine


@asynccontextmanager
async def _running_engine(model_dir: Path, work_dir: Path, label: str) -> AsyncIterator[EngineProcess]:
    """A started engine serving ``model_dir`` (its start printed under ``label``), stopped on leaving."""
    eng = await _start_engine(model_dir, work_dir)
    print(f"\n[{label}] started in {eng.start_seconds:.1f}s at {eng.base_url} pid {eng.pid}")
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="session")
def running_engine():
    """``async with running_engine(model_dir, work_dir, label) as engine``: an engine of its own."""
    return _running_engine


@pytest.fixture(scope="session")
async def engine(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineProcess]:
    url = os.environ.get("ROLLOUTS_TEST_ENGINE_URL")
    if url:
        # Development: reuse an engine already serving workers.base_model's base model under
        # the name "base" with our extension (tests load the weights they need).
        yield EngineProcess.attach(
            url, served_model_name=SERVED_NAME, secret=os.environ.get("ROLLOUTS_TEST_ENGINE_SECRET")
        )
        return
    async with _running_engine(model_dirs["base"], tmp_path_factory.mktemp("engine-a"), "engine") as eng:
        yield eng
