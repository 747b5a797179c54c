"""64 concurrent rollout clients across a delta hot-load on Dynamo workers behind Dynamo's
frontend (tests/helpers/load.py says what is checked and printed)."""

from __future__ import annotations

import pytest

from tests.helpers.gateway import GatewayDeployment
from tests.helpers.load import load_across_a_delta_hot_load

pytestmark = pytest.mark.stack


async def test_64_concurrent_rollouts_across_a_delta_hot_load_on_dynamo(dynamo_stack, dyn, tmp_path_factory):
    api, dep = dyn
    await load_across_a_delta_hot_load(GatewayDeployment(dynamo_stack, api, dep), tmp_path_factory.mktemp("load"))
