"""Fault points: named places in a replica agent's steps where a test can make it fail or wait.

Inert unless `Settings.home / "faults.json"` exists; it is read at every fault point (one
`stat` when absent), so a test arms and disarms faults while the stack runs::

    {"rules": [{"id": "r1", "point": "stage_from_peer", "replica": "my-dep-1",
                "action": "fail", "times": 1}]}

`point` is one of `POINTS`; `replica` a name or "*"; optional `deployment`; `action`: "fail"
(non-retryable `InjectedFault`), "s3_error" (botocore's HTTP 500 `ClientError`), or "hold"
(`seconds`, default 3600, or until the rule is removed; a cancel ends it); `times` per agent
process, counted by `id`. A fault point changes nothing by itself: each sits where a real
failure could happen, so the step's own failure handling runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError

from contracts.errors import INJECTED_FAULT

log = logging.getLogger("rollouts.replica.faults")

# Where callers put a fault point.
POINTS = (
    "apply_snapshot",  # a step from the bucket starts (before anything is read)
    # a receiver's stage from the broadcast, once the bytes arrived (dropped; it then reads the bucket)
    "stage_from_peer",
    "commit_peer_stage",  # a receiver's swap of its broadcast stage starts (it then reads the bucket)
    "pause",  # a stage is ready and its pause is about to begin (nothing of it is in the engine yet)
    "swap",  # inside the pause, after the stage was applied and before it is proven and committed
    "model_download",  # a replica's start reads its model from the bucket (each attempt)
)
FAULTS_FILE = "faults.json"
_fired: Counter[str] = Counter()


def _rules(home: Path) -> list[dict[str, Any]]:
    path = home / FAULTS_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return []
    rules = doc.get("rules", []) if isinstance(doc, dict) else []
    return [r for r in rules if isinstance(r, dict)]


def _matches(rule: dict[str, Any], point: str, replica: str, deployment: str) -> bool:
    return (
        rule.get("point") == point
        and rule.get("replica", "*") in ("*", replica)
        and rule.get("deployment", deployment) == deployment
        and _fired[str(rule.get("id", ""))] < int(rule.get("times", 1))
    )


def armed(home: Path, point: str, *, replica: str, deployment: str) -> bool:
    """Whether a rule for `point` would fire on this replica now (it fires only at `hit`)."""
    return any(_matches(rule, point, replica, deployment) for rule in _rules(home))


async def hit(home: Path, point: str, *, replica: str, deployment: str, until: asyncio.Event | None = None) -> bool:
    """Fire the first armed rule for `point` on this replica, if any (see the module docstring).
    A "hold" also ends when `until` is set (the step was canceled); returns True then."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    for rule in _rules(home):
        if not _matches(rule, point, replica, deployment):
            continue
        rule_id = str(rule.get("id", ""))
        _fired[rule_id] += 1
        action = rule.get("action", "fail")
        log.warning("fault %s fires at %s on %s: %s", rule_id, point, replica, action)
        if action == "hold":
            waited, limit = 0.0, float(rule.get("seconds", 3600))
            while waited < limit and any(str(r.get("id", "")) == rule_id for r in _rules(home)):
                if until is not None and until.is_set():
                    return True
                await asyncio.sleep(0.2)
                waited += 0.2
            return False
        if action == "s3_error":
            raise ClientError(
                {
                    "Error": {"Code": "InternalError", "Message": f"injected fault {rule_id!r} at {point}"},
                    "ResponseMetadata": {"HTTPStatusCode": 500},
                },
                "GetObject",
            )
        raise ApplicationError(
            f"injected fault {rule_id!r} at {point} on replica {replica}", type=INJECTED_FAULT, non_retryable=True
        )
    return False
