"""Fault points (replica/faults.py) without a stack: inert without faults.json, a "fail" raises a
non-retryable InjectedFault once per rule id, and a "hold" ends when its rule is removed or when
the step is canceled (``until``)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from contracts.errors import INJECTED_FAULT
from replica import faults


def arm(home: Path, **rule: object) -> str:
    rule_id = f"r-{uuid.uuid4().hex[:8]}"
    (home / faults.FAULTS_FILE).write_text(json.dumps({"rules": [{"id": rule_id, **rule}]}))
    return rule_id


async def test_inert_without_the_file_and_for_other_replicas(tmp_path: Path) -> None:
    assert await faults.hit(tmp_path, "swap", replica="r1", deployment="d") is False
    arm(tmp_path, point="swap", replica="r2", action="fail")
    assert await faults.hit(tmp_path, "swap", replica="r1", deployment="d") is False
    with pytest.raises(ValueError, match="unknown fault point"):
        await faults.hit(tmp_path, "nowhere", replica="r1", deployment="d")


async def test_a_fail_fires_once_per_rule(tmp_path: Path) -> None:
    rule = arm(tmp_path, point="stage_from_peer", replica="*", action="fail")
    with pytest.raises(ApplicationError) as err:
        await faults.hit(tmp_path, "stage_from_peer", replica="r1", deployment="d")
    assert err.value.type == INJECTED_FAULT and err.value.non_retryable and rule in err.value.message
    assert await faults.hit(tmp_path, "stage_from_peer", replica="r1", deployment="d") is False


async def test_a_hold_ends_when_the_step_is_canceled_or_the_rule_is_removed(tmp_path: Path) -> None:
    arm(tmp_path, point="swap", action="hold")
    canceled = asyncio.Event()
    held = asyncio.ensure_future(faults.hit(tmp_path, "swap", replica="r1", deployment="d", until=canceled))
    await asyncio.sleep(0.5)
    assert not held.done()
    canceled.set()
    assert await asyncio.wait_for(held, 30) is True  # the bound guards a hang only

    arm(tmp_path, point="swap", action="hold")
    held = asyncio.ensure_future(faults.hit(tmp_path, "swap", replica="r1", deployment="d"))
    await asyncio.sleep(0.5)
    assert not held.done()
    (tmp_path / faults.FAULTS_FILE).unlink()
    assert await asyncio.wait_for(held, 30) is False
