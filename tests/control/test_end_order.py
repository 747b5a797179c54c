"""Terminal means admitted: a hot-load's end becomes visible (its memo's `hotLoad` state, its
`HotLoadState` search attribute) only after its deployment holds the `hot_load_finished` signal.

Read from the exported histories of the real workflows (tests/histories, which
tests/ops/test_history_check.py replays against the current code, so they are this code's
order): in each, the signal to the deployment was delivered (`EXTERNAL_WORKFLOW_EXECUTION_SIGNALED`)
before any event that shows a terminal state. A create sent after a read of the end therefore
reaches a deployment whose history already holds the end (tests/simulated/test_simulated_walk.py
hunts the window end to end)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from contracts import names
from contracts.records import TERMINAL_HOT_LOAD_STATES

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("hotLoads%2F*.json"))


def _decoded(payload: dict) -> object:
    return json.loads(base64.b64decode(payload["data"]))


def shown_state(event: dict) -> str | None:
    """The operation's state an event makes visible (memo or search attribute), if any."""
    memo = event.get("workflowPropertiesModifiedEventAttributes", {}).get("upsertedMemo", {}).get("fields", {})
    if "hotLoad" in memo:
        return _decoded(memo["hotLoad"])["status"]["state"]
    fields = event.get("upsertWorkflowSearchAttributesEventAttributes", {}).get("searchAttributes", {})
    if "HotLoadState" in fields.get("indexedFields", {}):
        return _decoded(fields["indexedFields"]["HotLoadState"])
    return None


def first_terminal_and_finished_signal(events: list[dict]) -> tuple[int, int | None]:
    """(index of the first event showing a terminal state, index of the delivered
    `hot_load_finished` signal or None)."""
    finished_initiated = {
        e["eventId"]
        for e in events
        if e.get("signalExternalWorkflowExecutionInitiatedEventAttributes", {}).get("signalName")
        == names.HOT_LOAD_FINISHED
    }
    terminal = next(i for i, e in enumerate(events) if shown_state(e) in TERMINAL_HOT_LOAD_STATES)
    delivered = next(
        (
            i
            for i, e in enumerate(events)
            if e.get("externalWorkflowExecutionSignaledEventAttributes", {}).get("initiatedEventId")
            in finished_initiated
        ),
        None,
    )
    return terminal, delivered


def test_every_hot_load_path_is_recorded():
    assert len(HISTORIES) >= 4, HISTORIES


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem.rsplit("%2F", 1)[-1])
def test_the_deployment_holds_the_end_before_any_read_can_show_it(path):
    events = json.loads(path.read_text())["events"]
    terminal, delivered = first_terminal_and_finished_signal(events)
    assert delivered is not None, f"{path.name}: no hot_load_finished signal was delivered"
    assert delivered < terminal, (
        f"{path.name}: event {events[terminal]['eventId']} shows {shown_state(events[terminal])} before the "
        f"deployment held hot_load_finished (event {events[delivered]['eventId']})"
    )
