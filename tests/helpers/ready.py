"""Once the API has answered READY, the gateway serves: :data:`FIRST_REQUESTS` requests sent at
once through the gateway right after READY, addressed to the deployment by its id, are each
answered 200 (the gateway reads a deployment afresh before it would answer 503:
``gateway.routing.Router.fresh_route``).

Every test that creates a deployment and waits for READY (as ``cwtrain deployment create
--wait`` does) calls :func:`first_requests_served`, so each run checks it once per deployment
it creates; :data:`TRIALS` keeps every check of the session with the deployments the API listed
READY beside it at that moment, and tests/conftest.py prints the tally after the run (every
worker's checks together).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from common.settings import Settings
from tests.helpers.deployments import delete_deployment

FIRST_REQUESTS = 16


@dataclass(frozen=True)
class Trial:
    deployment: str
    beside: tuple[str, ...]  # other deployments READY on the stack when it was checked


TRIALS: list[Trial] = []


def first_requests_served(settings: Settings, dep_id: str, token: str | None = None) -> Trial:
    """Send FIRST_REQUESTS completions at once to ``dep_id`` through ``settings``' gateway, now,
    and fail unless every one is answered 200."""
    headers = {"Authorization": f"Bearer {token or settings.admin_token}"}
    listed = httpx.get(f"{settings.api_url}/v1alpha1/inference/deployments", headers=headers, timeout=60)
    assert listed.status_code == 200, listed.text
    beside = tuple(
        sorted(
            d["spec"]["id"]
            for d in listed.json().get("items", [])
            if d["spec"]["id"] != dep_id and d["status"]["status"] == "STATUS_READY"
        )
    )
    body = {"model": dep_id, "prompt": [1, 2, 3], "max_tokens": 2}
    with ThreadPoolExecutor(FIRST_REQUESTS) as pool:
        answers = list(
            pool.map(
                lambda _: httpx.post(f"{settings.gateway_url}/v1/completions", json=body, headers=headers, timeout=300),
                range(FIRST_REQUESTS),
            )
        )
    refused = [f"{r.status_code}: {r.text[:300]}" for r in answers if r.status_code != 200]
    assert not refused, (
        f"right after READY, {len(refused)} of {FIRST_REQUESTS} requests to {dep_id} were refused "
        f"({len(beside)} other deployment(s) READY beside it): {refused[:3]}"
    )
    trial = Trial(dep_id, beside)
    TRIALS.append(trial)
    return trial


def served_or_deleted(settings: Settings, api: Any, dep_id: str) -> Trial:
    """`first_requests_served`, and the deployment deleted when it fails: a pooled deployment
    whose creation fails is in no pool, and its engines would outlive the test."""
    try:
        return first_requests_served(settings, dep_id)
    except BaseException:
        delete_deployment(api, dep_id)
        raise


def counts() -> tuple[int, int]:
    """(deployments checked, those checked with another deployment READY beside) in this process."""
    return len(TRIALS), sum(1 for t in TRIALS if t.beside)


def tally(per_process: list[tuple[int, int]]) -> str | None:
    """One line for the run, from each process's :func:`counts` (one, or one per xdist worker)."""
    checked, with_others = (sum(n) for n in zip(*per_process)) if per_process else (0, 0)
    if not checked:
        return None
    return (
        f"READY, then {FIRST_REQUESTS} requests at once: {checked} deployment(s), every request "
        f"answered 200 ({with_others} with another deployment READY beside)"
    )
