"""Operator commands over the REST API and Temporal histories (`rollouts replay | rollback |
history check | hotload wait`).

`replay HOT_LOAD_ID` starts a new hot-load of the same snapshot and settings; `rollback IDENTITY
--deployment D` re-serves an earlier snapshot with the type and metadata of its newest COMPLETED
hot-load on D. Both wait, print one line per change, and exit 0 only when it ends COMPLETED
(else 1 with the reason). They use the stack's admin token (`ROLLOUTS_API_URL`, `CW_API_TOKEN`,
else `$ROLLOUTS_HOME/stack.json`). `history check DIR` replays every exported `*.json` history
(workflow id = file name, `%2F` for `/`) against the current workflow classes; exit 1 on any
nondeterminism.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote

import httpx
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from common import envs
from common.settings import Settings
from contracts.records import TERMINAL_HOT_LOAD_STATES
from control.deployment import DeploymentWorkflow
from control.gateway import GatewayWorkflow
from control.hot_load.workflow import HotLoadWorkflow

PREFIX = "/v1alpha1/inference"


class OpsError(RuntimeError):
    """A one-line reason an operator command failed (printed, exit 1)."""


@dataclass
class ApiTarget:
    url: str
    token: str

    @classmethod
    def from_environment(cls, home: Path | None = None) -> ApiTarget:
        url, token = envs.ROLLOUTS_API_URL.get(), os.environ.get("CW_API_TOKEN")
        if not (url and token):
            settings = Settings.load(home)
            url, token = url or settings.api_url, token or settings.admin_token
        return cls(url=url.rstrip("/"), token=token)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"{self.url}{PREFIX}", headers={"Authorization": f"Bearer {self.token}"}, timeout=60
        )


async def _json(http: httpx.AsyncClient, method: str, path: str, **kw: Any) -> dict[str, Any]:
    try:
        r = await http.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise OpsError(f"the API at {http.base_url} is unreachable: {exc}") from None
    try:
        body = r.json()
    except ValueError:
        body = {"message": r.text[:200]}
    if r.status_code != 200:
        raise OpsError(f"{method} {path}: {body.get('code', r.status_code)}: {body.get('message', '')}")
    return body


def create_body_like(hot_load: dict[str, Any], new_id: str) -> dict[str, Any]:
    """A create request repeating `hot_load`'s target: deployment, identity, type, metadata, policy."""
    spec = hot_load["spec"]
    body = {
        "deploymentId": spec["deploymentId"],
        "hotLoadId": new_id,
        "identity": spec["identity"],
        "type": spec["type"],
        "promptCachePolicy": spec.get("promptCachePolicy", "PROMPT_CACHE_POLICY_PRESERVE"),
    }
    if spec.get("incrementalSnapshotMetadata"):
        body["incrementalSnapshotMetadata"] = spec["incrementalSnapshotMetadata"]
    return body


async def list_all_hot_loads(http: httpx.AsyncClient, deployment_id: str) -> list[dict[str, Any]]:
    out, token = [], None
    while True:
        params: dict[str, Any] = {"parentDeploymentId": deployment_id, "maxPageSize": 1000}
        if token:
            params["pageToken"] = token
        body = await _json(http, "GET", "/hotLoads", params=params)
        out += body.get("hotLoads", [])
        token = body.get("nextPageToken")
        if not token:
            return out


def _progress_line(hot_load: dict[str, Any], replicas: list[dict[str, Any]]) -> str:
    st = hot_load["status"]
    ready = sum(
        1
        for r in replicas
        if r["state"] == "READY" and r.get("currentSnapshotIdentity") == hot_load["spec"]["identity"]
    )
    parts = ", ".join(
        f"{r['name']} {r['state']}" + (f" ({r['errorReason']})" if r.get("errorReason") else "") for r in replicas
    )
    return (
        f"{hot_load['spec']['id']} {st['state'].removeprefix('HOT_LOAD_STATE_')} {ready}/{len(replicas)} ready: {parts}"
    )


def failure_reason(hot_load: dict[str, Any], replicas: list[dict[str, Any]]) -> str:
    st = hot_load["status"]
    why = [c.get("message", "") for c in st.get("conditions", []) if c.get("type") in ("Failed", "Canceled")]
    errors = [f"{r['name']}: {r['errorReason']}" for r in replicas if r.get("errorReason")]
    return "; ".join(why + errors) or st["state"]


async def wait_and_report(
    http: httpx.AsyncClient, hot_load_id: str, *, out: TextIO, poll_s: float = 1.0, timeout_s: float = 3600
) -> int:
    """Poll until the operation ends, printing a line whenever something changed."""
    last = ""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        hot_load = (await _json(http, "GET", f"/hotLoads/{hot_load_id}"))["hotLoad"]
        replicas = (await _json(http, "GET", f"/hotLoads/{hot_load_id}/replicas", params={"maxPageSize": 1000}))[
            "replicas"
        ]
        line = _progress_line(hot_load, replicas)
        if line != last:
            print(line, file=out, flush=True)
            last = line
        state = hot_load["status"]["state"]
        if state in TERMINAL_HOT_LOAD_STATES:
            if state == "HOT_LOAD_STATE_COMPLETED":
                return 0
            raise OpsError(f"hot-load {hot_load_id} ended {state}: {failure_reason(hot_load, replicas)}")
        if asyncio.get_running_loop().time() > deadline:
            raise OpsError(f"hot-load {hot_load_id} still {state} after {timeout_s:.0f}s; it goes on (rerun to wait)")
        await asyncio.sleep(poll_s)


async def replay(http: httpx.AsyncClient, hot_load_id: str, *, out: TextIO, poll_s: float = 1.0) -> int:
    original = (await _json(http, "GET", f"/hotLoads/{hot_load_id}"))["hotLoad"]
    intro = f"replaying {hot_load_id} ({original['spec']['identity']}, {original['spec']['type']}) as"
    return await _again_like(http, original, intro, out=out, poll_s=poll_s)


async def rollback(
    http: httpx.AsyncClient, identity: str, deployment_id: str, *, out: TextIO, poll_s: float = 1.0
) -> int:
    history = await list_all_hot_loads(http, deployment_id)  # newest first
    earlier = next(
        (
            h
            for h in history
            if h["spec"]["identity"] == identity and h["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        ),
        None,
    )
    if earlier is None:
        raise OpsError(f"no COMPLETED hot-load of {identity!r} on deployment {deployment_id}: nothing to roll back to")
    intro = f"rolling {deployment_id} back to {identity} (as {earlier['spec']['id']} loaded it) with"
    return await _again_like(http, earlier, intro, out=out, poll_s=poll_s)


async def _again_like(http: httpx.AsyncClient, earlier: dict, intro: str, *, out: TextIO, poll_s: float) -> int:
    """Create a new hot-load of the same snapshot as ``earlier`` (a new id), say so after
    ``intro``, and wait for its end."""
    body = create_body_like(earlier, str(uuid.uuid4()))
    created = (await _json(http, "POST", "/hotLoads", json=body))["hotLoad"]
    print(f"{intro} {created['spec']['id']}; {created['status'].get('workflowUrl', '')}", file=out, flush=True)
    return await wait_and_report(http, created["spec"]["id"], out=out, poll_s=poll_s)


# ---------------------------------------------------------------------- histories
def workflow_classes() -> list[type]:
    return [DeploymentWorkflow, GatewayWorkflow, HotLoadWorkflow]


def workflow_id_of(path: Path) -> str:
    return unquote(path.name.removesuffix(".json"))


async def history_check(directory: Path, *, out: TextIO) -> int:
    """Replay every exported history in `directory`; 0 when all replay cleanly."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise OpsError(f"no *.json histories in {directory}")
    replayer = Replayer(workflows=workflow_classes(), data_converter=pydantic_data_converter)
    failures = 0
    for path in files:
        try:
            history = WorkflowHistory.from_json(workflow_id_of(path), json.loads(path.read_text()))
            result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
            problem = result.replay_failure
        except Exception as exc:  # noqa: BLE001 - a malformed file is a failure to report, not a crash
            problem = exc
        if problem is None:
            print(f"ok    {path.name}", file=out)
        else:
            failures += 1
            print(
                f"FAIL  {path.name}: {type(problem).__name__}: {str(problem).splitlines()[0] if str(problem) else ''}",
                file=out,
            )
    print(f"{len(files) - failures}/{len(files)} histories replay against the current workflow code", file=out)
    return 1 if failures else 0


# ---------------------------------------------------------------------- CLI glue
def run(coro_factory: Callable[[httpx.AsyncClient], Any], home: Path | None) -> int:
    async def main() -> int:
        async with ApiTarget.from_environment(home).client() as http:
            return await coro_factory(http)

    try:
        return asyncio.run(main())
    except OpsError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1
