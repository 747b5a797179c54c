"""Shared fixtures. The embedded stack is started once per test session, on free loopback
ports in a temporary home, and stopped by pid at the end; vLLM replicas are expensive (about a
minute each on two cores), so tests share deployments where they can."""

from __future__ import annotations

import pytest

from tests.helpers.stack_fixtures import start_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("rollouts-home")
    stack, settings = start_stack(home)
    try:
        yield settings
    finally:
        stack.down(say=lambda line: print(line, flush=True))
