"""The trainer's side of rollouts: a small typed client for the REST API, and strictly
on-policy rounds as one call.

Contract:

- ``RolloutsClient(api_url, token)`` (or ``RolloutsClient.from_env()``: ``ROLLOUTS_API_URL``,
  ``CW_API_TOKEN``) speaks ``/v1alpha1/inference`` with the bearer token. Every non-2xx answer
  raises ``ApiError`` (``status``, ``code``, ``message`` from the ``{"code", "message"}`` body).
  Calls: ``get_deployment``, ``create_hot_load`` (a client-chosen ``hot_load_id`` is always
  sent, so a retried create is safe; with ``wait_if_busy`` it waits out another active
  hot-load, as cwtrain does, and creates again), ``get_hot_load``, ``list_replicas`` (every
  page), ``cancel_hot_load``, ``wait_hot_load`` (until a terminal state), ``wait_ready``
  (until every replica is READY on an identity: the guide's replica check).
- ``upload_checkpoint(s3, local_dir, bucket, prefix, identity)`` copies a checkpoint directory's
  top-level files to ``s3://bucket/prefix/identity/``, the index last (so a reader that sees the
  index sees the shards it names).
- ``RoundGate`` counts a trainer's in-flight rollout requests (``with gate.request():`` from
  threads, ``async with gate.arequest():`` from asyncio) and, while closed, holds new ones back.
- ``on_policy_round(client, deployment_id, checkpoint_dir, identity, ...)`` is the guide's "Run
  strictly on-policy rounds": close the gate and wait until no request is in flight; upload the
  checkpoint (full, or a delta when ``previous_identity`` names its base) to the deployment's
  hot-load bucket and prefix; create a hot-load with ``PROMPT_CACHE_POLICY_RESET_ALL``; wait for
  it to complete and for every replica to be READY on ``identity``; reopen the gate; return a
  ``RoundResult`` with the hot-load, the replicas and the time each phase took. A hot-load that
  does not complete raises ``RoundFailed`` and leaves the gate closed: the guide says to keep
  on-policy generation paused until every replica serves the target (recover, then
  ``gate.open()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PREFIX = "/v1alpha1/inference"
TERMINAL_STATES = ("HOT_LOAD_STATE_COMPLETED", "HOT_LOAD_STATE_FAILED", "HOT_LOAD_STATE_CANCELED")
FULL = "SNAPSHOT_TYPE_FULL"
INCREMENTAL = "SNAPSHOT_TYPE_INCREMENTAL"
PRESERVE = "PROMPT_CACHE_POLICY_PRESERVE"
RESET_ALL = "PROMPT_CACHE_POLICY_RESET_ALL"
INDEX_NAME = "model.safetensors.index.json"


class ApiError(RuntimeError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class RoundFailed(RuntimeError):
    """The round's hot-load did not end with every replica READY on the new identity."""

    def __init__(self, message: str, hot_load: HotLoad | None, replicas: list[Replica]) -> None:
        super().__init__(message)
        self.hot_load = hot_load
        self.replicas = replicas


@dataclass(frozen=True)
class Replica:
    name: str
    state: str
    current_snapshot_identity: str
    zone: str = ""
    error_reason: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Replica:
        return cls(
            name=obj.get("name", ""),
            state=obj.get("state", ""),
            current_snapshot_identity=obj.get("currentSnapshotIdentity", ""),
            zone=obj.get("zone", ""),
            error_reason=obj.get("errorReason"),
            raw=obj,
        )


@dataclass(frozen=True)
class HotLoad:
    id: str
    deployment_id: str
    identity: str
    type: str
    state: str
    prompt_cache_policy: str
    snapshot_chain: list[str]
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> HotLoad:
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        return cls(
            id=spec.get("id", ""),
            deployment_id=spec.get("deploymentId", ""),
            identity=spec.get("identity", ""),
            type=spec.get("type", ""),
            state=status.get("state", ""),
            prompt_cache_policy=spec.get("promptCachePolicy", PRESERVE),
            snapshot_chain=[link.get("identity", "") for link in spec.get("snapshotChain") or []],
            raw=obj,
        )


def hot_load_body(
    deployment_id: str,
    identity: str,
    *,
    previous_identity: str | None = None,
    prompt_cache_policy: str | None = None,
    hot_load_id: str | None = None,
) -> dict[str, Any]:
    """The body of ``POST /hotLoads``: FULL, or INCREMENTAL (zstd, Adler-32) on ``previous_identity``;
    the cache policy and the hot-load id only when given (else the API's defaults)."""
    body: dict[str, Any] = {
        "deploymentId": deployment_id,
        "identity": identity,
        "type": FULL if previous_identity is None else INCREMENTAL,
    }
    if hot_load_id is not None:
        body["hotLoadId"] = hot_load_id
    if prompt_cache_policy is not None:
        body["promptCachePolicy"] = prompt_cache_policy
    if previous_identity is not None:
        body["incrementalSnapshotMetadata"] = {
            "previousSnapshotIdentity": previous_identity,
            "compressionFormat": "COMPRESSION_FORMAT_ZSTD",
            "checksumFormat": "CHECKSUM_FORMAT_ADLER32",
        }
    return body


class RolloutsClient:
    """Typed calls to the REST API (see the module docstring)."""

    def __init__(
        self, api_url: str, token: str, *, timeout: float = 60.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self._http = httpx.Client(
            base_url=api_url.rstrip("/") + PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RolloutsClient:
        env = os.environ if environ is None else environ
        return cls(env["ROLLOUTS_API_URL"], env["CW_API_TOKEN"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        resp = self._http.request(method, path, **kw)
        if resp.status_code // 100 != 2:
            try:
                body = resp.json()
            except ValueError:
                body = {}
            raise ApiError(
                resp.status_code, str(body.get("code", "unknown")), str(body.get("message", resp.text[:500]))
            )
        return resp.json()

    # ------------------------------------------------------------------ reads
    def get_deployment(self, deployment_id: str) -> dict[str, Any]:
        return self._call("GET", f"/deployments/{deployment_id}")["deployment"]

    def get_hot_load(self, hot_load_id: str) -> HotLoad:
        return HotLoad.from_wire(self._call("GET", f"/hotLoads/{hot_load_id}")["hotLoad"])

    def list_hot_loads(self, deployment_id: str) -> list[HotLoad]:
        out: list[HotLoad] = []
        token = ""
        while True:
            params = {
                "parentDeploymentId": deployment_id,
                "maxPageSize": 1000,
                **({"pageToken": token} if token else {}),
            }
            page = self._call("GET", "/hotLoads", params=params)
            out += [HotLoad.from_wire(h) for h in page.get("hotLoads") or []]
            token = page.get("nextPageToken") or ""
            if not token:
                return out

    def list_replicas(self, hot_load_id: str) -> list[Replica]:
        out: list[Replica] = []
        token = ""
        while True:
            params = {"maxPageSize": 1000, **({"pageToken": token} if token else {})}
            page = self._call("GET", f"/hotLoads/{hot_load_id}/replicas", params=params)
            out += [Replica.from_wire(r) for r in page.get("replicas") or []]
            token = page.get("nextPageToken") or ""
            if not token:
                return out

    # ------------------------------------------------------------------ writes
    def create_hot_load(
        self,
        deployment_id: str,
        identity: str,
        *,
        previous_identity: str | None = None,
        prompt_cache_policy: str = PRESERVE,
        hot_load_id: str | None = None,
        wait_if_busy: bool = True,
        busy_timeout: float = 900.0,
    ) -> HotLoad:
        """A FULL hot-load, or an INCREMENTAL one when ``previous_identity`` names the delta's base."""
        body = hot_load_body(
            deployment_id,
            identity,
            previous_identity=previous_identity,
            prompt_cache_policy=prompt_cache_policy,
            hot_load_id=hot_load_id or f"hl-{uuid.uuid4().hex[:16]}",
        )
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                return HotLoad.from_wire(self._call("POST", "/hotLoads", json=body)["hotLoad"])
            except ApiError as exc:
                if exc.code == "already_exists":
                    return self.get_hot_load(body["hotLoadId"])
                busy = exc.code == "failed_precondition" and "already in progress" in exc.message
                if not (busy and wait_if_busy) or time.monotonic() > deadline:
                    raise
            for other in self.list_hot_loads(deployment_id):
                if not other.terminal:
                    self.wait_hot_load(other.id, timeout=max(1.0, deadline - time.monotonic()))

    def cancel_hot_load(self, hot_load_id: str) -> HotLoad:
        return HotLoad.from_wire(self._call("POST", f"/hotLoads/{hot_load_id}:cancel", json={})["hotLoad"])

    # ------------------------------------------------------------------ waits
    def wait_hot_load(self, hot_load_id: str, *, timeout: float = 900.0, poll: float = 0.5) -> HotLoad:
        deadline = time.monotonic() + timeout
        while True:
            hot_load = self.get_hot_load(hot_load_id)
            if hot_load.terminal:
                return hot_load
            if time.monotonic() > deadline:
                raise TimeoutError(f"hot-load {hot_load_id} still {hot_load.state} after {timeout:.0f}s")
            time.sleep(poll)

    def wait_ready(self, hot_load_id: str, identity: str, *, timeout: float = 60.0, poll: float = 0.5) -> list[Replica]:
        """Every listed replica READY on ``identity`` (and at least one listed), else TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            replicas = self.list_replicas(hot_load_id)
            if replicas and all(r.state == "READY" and r.current_snapshot_identity == identity for r in replicas):
                return replicas
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every replica is READY on {identity}: {replicas}")
            time.sleep(poll)


def upload_checkpoint(s3: Any, local_dir: Path | str, bucket: str, prefix: str, identity: str) -> list[str]:
    """Upload the top-level files of ``local_dir`` to ``s3://bucket/prefix/identity/``, index last."""
    local_dir = Path(local_dir)
    files = sorted((p for p in local_dir.iterdir() if p.is_file()), key=lambda p: (p.name == INDEX_NAME, p.name))
    if not any(p.name == INDEX_NAME for p in files):
        raise FileNotFoundError(f"{local_dir} has no {INDEX_NAME}: not a checkpoint directory")
    base = "/".join(x for x in (prefix.strip("/"), identity) if x)
    keys = []
    for path in files:
        key = f"{base}/{path.name}"
        s3.upload_file(str(path), bucket, key)
        keys.append(key)
    return keys


def s3_client_from_env(environ: dict[str, str] | None = None) -> Any:
    """boto3 S3 client for ``AWS_ENDPOINT_URL_S3`` (or ``CW_S3_ENDPOINT``) with the AWS_* keys."""
    import boto3  # noqa: PLC0415 - boto3 loads only when uploading: the client is installed without the service

    env = os.environ if environ is None else environ
    return boto3.client(
        "s3",
        endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("CW_S3_ENDPOINT"),
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        region_name=env.get("AWS_REGION") or "us-east-1",
    )


class RoundGate:
    """Counts in-flight rollout requests; while closed, new ones wait (threads and asyncio)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._open = True

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        with self._cond:
            self._open = False

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once no request is in flight (call after ``close``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def _try_enter(self) -> bool:
        with self._cond:
            if not self._open:
                return False
            self._in_flight += 1
            return True

    def _exit(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._open)
            self._in_flight += 1
        try:
            yield
        finally:
            self._exit()

    @contextlib.asynccontextmanager
    async def arequest(self, poll: float = 0.05) -> AsyncIterator[None]:
        # Polling keeps the event loop free; the gate may be opened from another thread.
        while not self._try_enter():
            await asyncio.sleep(poll)
        try:
            yield
        finally:
            self._exit()


@dataclass
class RoundResult:
    hot_load: HotLoad
    replicas: list[Replica]
    drain_s: float
    upload_s: float
    hot_load_s: float


def on_policy_round(
    client: RolloutsClient,
    deployment_id: str,
    checkpoint_dir: Path | str,
    identity: str,
    *,
    previous_identity: str | None = None,
    gate: RoundGate | None = None,
    s3: Any = None,
    drain_timeout: float = 900.0,
    timeout: float = 900.0,
) -> RoundResult:
    """One strictly on-policy boundary (see the module docstring)."""
    t0 = time.monotonic()
    if gate is not None:
        gate.close()
        if not gate.wait_idle(drain_timeout):
            gate.open()
            raise TimeoutError(f"{gate.in_flight} rollout request(s) still in flight after {drain_timeout:.0f}s")
    t1 = time.monotonic()
    deployment = client.get_deployment(deployment_id)
    hot = (deployment.get("spec") or {}).get("hotLoad") or {}
    if not hot.get("bucket"):
        raise ValueError(f"deployment {deployment_id} has no hotLoad section")
    upload_checkpoint(
        s3 if s3 is not None else s3_client_from_env(),
        checkpoint_dir,
        hot["bucket"],
        hot.get("pathPrefix", ""),
        identity,
    )
    t2 = time.monotonic()
    hot_load = client.create_hot_load(
        deployment_id, identity, previous_identity=previous_identity, prompt_cache_policy=RESET_ALL
    )
    hot_load = client.wait_hot_load(hot_load.id, timeout=timeout)
    replicas = client.list_replicas(hot_load.id)
    if hot_load.state != "HOT_LOAD_STATE_COMPLETED":
        reasons = "; ".join(f"{r.name}: {r.state} {r.error_reason or ''}".strip() for r in replicas)
        raise RoundFailed(f"hot-load {hot_load.id} of {identity} ended {hot_load.state}: {reasons}", hot_load, replicas)
    try:
        replicas = client.wait_ready(hot_load.id, identity, timeout=60.0)
    except TimeoutError as exc:
        raise RoundFailed(str(exc), hot_load, replicas) from None
    t3 = time.monotonic()
    if gate is not None:
        gate.open()
    return RoundResult(hot_load=hot_load, replicas=replicas, drain_s=t1 - t0, upload_s=t2 - t1, hot_load_s=t3 - t2)
