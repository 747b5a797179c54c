"""64 concurrent rollout clients across a delta hot-load on the gateway's Dynamo vLLM workers
(tests/helpers/load.py says what is checked and printed)."""

from __future__ import annotations

import pytest

from tests.helpers.load import load_across_a_delta_hot_load

pytestmark = pytest.mark.stack


async def test_64_concurrent_rollouts_across_a_delta_hot_load(gw, tmp_path_factory):
    await load_across_a_delta_hot_load(gw, tmp_path_factory.mktemp("load"))
